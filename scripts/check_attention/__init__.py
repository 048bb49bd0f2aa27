"""Check anyone's causal self-attention against the cheat sheet: `python -m
scripts.check_attention FILE.py:NAME` (__main__.py). sandbox.py and runner.py run the file in a
child that confine.py shuts in, and answers.py checks what the child sends back; layouts.py,
variants.py and diagnosis.py map its weights onto our layer and name the mistake; checks.py runs
the checklist; compare.py and report.py judge and print."""
