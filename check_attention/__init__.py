"""Check anyone's causal self-attention against the cheat sheet: `python -m check_attention
FILE.py:NAME` (__main__.py), a folder of them as one table (grade.py), or from a course's own
tests:

    from check_attention import check
    report = check("path/file.py:Name")          # or check(TheClass), check(the_function)
    assert report.passed, report.text

checklist.py holds the checks, one table. sandbox/ runs the file in a child that it shuts in
(a function wrapped as a layer), and checks what the child sends back; layouts.py, variants.py
and diagnosis.py read its weights onto our layer and name the mistake; checks.py runs the
checklist and probes.py the deeper probes, over target.py's one interface to the object;
compare.py and report.py judge and print; costs.py quotes what each mistake it names measurably
costs (docs/pitfall_costs.json, the studies' own file); inert.py makes every text a submission
chose (names, messages) inert before it is shown or written.

May import: safeio, model, training, guard. (The checker judges against the project's own
equation and pitfall table; your_layer.py puts a learner's layer into the project's GPT and its
runs; sandbox/ imports nothing of the project.)
"""


def check(target, **options):
    """grade.check: imported when called, so that `--help` and a mistyped command never wait for
    torch."""
    from check_attention.grade import check as check_one
    return check_one(target, **options)
