"""Check anyone's causal self-attention against the cheat sheet: `python -m
scripts.check_attention FILE.py:NAME` (__main__.py), a folder of them as one table (grade.py), or
from a course's own tests:

    from scripts.check_attention import check
    report = check("path/file.py:Name")          # or check(TheClass), check(the_function)
    assert report.passed, report.text

sandbox.py and runner.py run the file in a child that confine.py shuts in, and answers.py checks
what the child sends back; layouts.py, variants.py and diagnosis.py map its weights onto our layer
and name the mistake; checks.py runs the checklist; compare.py and report.py judge and print."""


def check(target, **options):
    """grade.check: imported when called, so that `--help` and a mistyped command never wait for
    torch."""
    from scripts.check_attention.grade import check as check_one
    return check_one(target, **options)
