"""Everything train.py needs around the model: config, optimiser, checkpoints, evaluation, logs.

May import: safeio, model, data, interop.
"""
