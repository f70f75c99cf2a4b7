"""Exercise 5, a reference solution: stages - stage - 1 warm-up forwards, then one forward and
one backward at a time, then the backwards left."""


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < microbatches:  # steady state: one in, one out
        order += [("F", forward), ("B", backward)]
        forward, backward = forward + 1, backward + 1
    order += [("B", i) for i in range(backward, microbatches)]  # cool-down
    return order
