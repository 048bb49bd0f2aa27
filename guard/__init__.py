"""The policy: what a user may ask for, where a run is written, and which weights are loaded.

May import: safeio, model, data, interop, training. The entry points (train.py, generate.py,
scripts/, bench/, tools/) and the checker above it (check_attention/) import guard/; nothing
below it does (tests/test_layers.py).

    compose.py         train.py's command line: options, the config composed by Hydra, --help
    limits.py          every value's range in one table, text, the device string
    memory.py          whether a run or a sampling command fits in the memory there is
    preflight.py       a run checked in full before anything is made; what a resume continues
    launch.py          starting what passed: a run's directory and record, a sweep's launcher
    sweep.py           a -m sweep's arms, their directories' names, Hydra's launcher
    run_dir.py         reading a run directory or a model folder, by the same checks: resume
                       targets, load_run (and load_folder) the one way either becomes a model
    weights_choice.py  which weights `weights=` loads: best, latest, or a folder's own
    retired.py         the keys train.py no longer has, which an older run's config may hold

The readers of untrusted formats, the error family and the system probes stand on the ground
floor, safeio/, which the core calls too.
"""
