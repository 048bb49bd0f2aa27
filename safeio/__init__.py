"""The ground floor: what any code of the project may need before it trusts a file or a value.

May import: nothing of the project (only the standard library and third-party packages).

    cli.py         the error family, one `error:` line per mistake (run_cli: also signals and
                   an unwritable stdout), the key=value parser
    key_help.py    `--help` of a key=value command, from its schema's field comments
    files.py       bounded, non-blocking reads of regular files; JSON; a run's plain-YAML config,
                   written so that it reads back
    corpus.py      corpus texts (and their overlap), the Shakespeare archive, token cache entries,
                   tokenizer.json
    checkpoint.py  a checkpoint's pointer, weights and training state (JSON and safetensors)
    hf.py          a Hugging Face model folder's files, for any architecture
    run_lock.py    one process at a time in a run directory
    system.py      what the machine and the launch say: available memory, torchrun's variables

Everything here reads and checks a format, and says in one line what is wrong with it. What a
user may ask for (the ranges, the memory a run needs) is policy, and is guard/'s.
"""
