"""The checker's sandbox: run someone else's attention code where it cannot touch the project.

host.py is the host process and the checker's handle on it (the protocol's frames, `Sandbox`,
`Child`); runner.py is what a child runs (import the user's file, build, call, answer); course.py
wraps course adapters (functions with their weights) as layers; confine.py shuts the host in
(Landlock, seccomp, limits); answers.py checks what a child sends back before the checker reads it.

May import: nothing of the project. The host runs these files as top-level modules of this folder,
before the project is on its path; tests/test_layers.py holds the rule.
"""
