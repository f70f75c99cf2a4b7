"""The bug zoo's exhibits (tutorials/bug_zoo.py runs them): base.py, what they share; ranks.py,
the bugs that need several ranks; local.py and resume.py, those one process can show."""
