"""Exercise 5: the 1F1B pipeline schedule, for any number of stages. (README section 9; hint:
hints/one_f_one_b.md)

    python tutorials/exercises/grade.py one_f_one_b

Graded on 2 gloo ranks (2 stages, 4 microbatches), your order run by the grader's own stage
runtime: every microbatch forward then backward once; no stage waits forever; the gradients equal
one process's; and stage s holds at most (stages - s) microbatches' activations at once (1F1B's
point: GPipe, all forwards first, holds all 4).
"""


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which `stage` (0 = first) runs its forwards ("F", i) and backwards ("B", i)
    of microbatches 0 .. microbatches - 1.

    1F1B: a few forwards to fill the pipe (the later the stage, the fewer), then alternate one
    forward and one backward, then the remaining backwards. Forward i of stage s needs forward i
    of stage s - 1; backward i of stage s needs backward i of stage s + 1.
    """
    raise NotImplementedError("write one_f_one_b: warm-up forwards, then F-B pairs, then Bs")
