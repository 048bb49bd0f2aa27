"""The policy: what a user may ask for, where a run is written, and which weights are loaded.

May import: safeio, model, data, interop, training. Only the entry points (train.py,
generate.py, scripts/, bench/, tools/) import guard/; nothing below it does
(tests/test_layers.py).

    limits.py          every value's range in one table, text, the device string, the memory a
                       run needs
    run_dir.py         reading a run directory or a model folder, by the same checks: resume
                       targets, load_run (and load_folder) the one way either becomes a model
    weights_choice.py  which weights `weights=` loads: best, latest, or a folder's own
    preflight.py       train.py's command line: compose once (Hydra's Compose API), check, place
                       the run (every arm of a -m sweep first), undo a failed run
    sweep.py           a -m sweep's arms, and the name of each arm's directory

The readers of untrusted formats, the error family and the system probes stand on the ground
floor, safeio/, which the core calls too.
"""
