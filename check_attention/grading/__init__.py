"""Grading, beside the checker: submission.py reads what a student or a platform hands over (a
file, a notebook, a folder; a course's export of every student), grade.py judges one into a
`Graded` and a course into one table with scores (weights.py), platforms.py writes one
submission's results for Gradescope, PrairieLearn or JUnit (docs/grading.md).
"""
