"""The guards: every check between the user (or a file from elsewhere) and the code that learns.

model/, data/, training/, train.py and generate.py keep what they are about; what a user may ask
for, and whether a file handed over is what it claims to be, is decided here, once, at the
boundary. Inside the core, a broken assumption is an assert.

    cli.py         the error family, one `error:` line per mistake (run_cli: also signals and
                   an unwritable stdout), the key=value parser
    files.py       bounded, non-blocking reads of regular files; JSON; a run's plain-YAML config,
                   written so that it reads back
    limits.py      every value's range in one table, text, the device string, torchrun's
                   variables, the memory a run needs
    corpus.py      corpus texts (and their overlap), the Shakespeare archive, token cache entries,
                   tokenizer.json
    checkpoint.py  a checkpoint's pointer, weights and training state (JSON and safetensors)
    hf.py          a Hugging Face model folder, for any architecture
    run_dir.py     reading a run directory or a model folder, by the same checks: resume targets,
                   load_run for sampling
    run_lock.py    one process at a time in a run directory
    preflight.py   train.py's command line: compose once (Hydra's Compose API), check, place
                   the run (every arm of a -m sweep first), undo a failed run
    sweep.py       a -m sweep's arms, and the name of each arm's directory

cli.py and files.py stand on the ground floor (data/ and interop/hf.py import them); limits.py
and what reads runs stand above the config dataclasses and the model.
"""
