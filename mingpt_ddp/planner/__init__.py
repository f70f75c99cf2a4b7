"""The planner: memory, bytes and time per GPU for any model shape and layout of the grid, for
GPUs this machine does not have, held against the layouts that run here.

shapes.py (the model, the layout, the machine), traffic.py (bytes per dimension: the formulas
the parallelism benchmark checks), memory.py (peak memory by category: traced under torch's
fake process group, or estimated), schedule.py (a pipeline rank's memory over its schedule's
actions), moe.py (what a mixture of experts adds), search.py (every layout, judged), __main__.py
(the command: python -m mingpt_ddp.planner). docs/planner.md teaches it with worked questions.
"""
