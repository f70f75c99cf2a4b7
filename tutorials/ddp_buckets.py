"""How DDP packs gradients into buckets, and in which order it all-reduces them.

    torchrun --standalone --nproc_per_node=2 tutorials/ddp_buckets.py [buckets.json]
    torchrun --standalone --nproc_per_node=2 tutorials/ddp_buckets.py --bucket-cap-mb 1

After its first iteration DDP neither all-reduces the GPT's 52 gradients one by one nor all at
once after backward (no overlap): it copies them into flat buckets and hands a bucket to
all-reduce once all its gradients are ready and every lower-numbered bucket has gone. (The
first backward is the exception the first table shows: DDP does not know the gradients' order
yet, so all 52 go in one bucket at the end.) A communication hook sees each bucket then; this
one records it and averages it over ranks, as DDP does by default. Each table is one backward
pass of the default GPT on random tokens; a legend printed before them explains every column
("full at" / "sent at" count the gradients ready when the bucket's last one arrived / when DDP
launched it) and the two notices torchrun and DDP print on stderr. The closing sentences are
computed from the tables; torch/nn/parallel/distributed.py (torch 2.13) says why. The optional
argument writes every bucket's parameter names as JSON (tests/test_ddp_buckets.py reads it).
--bucket-cap-mb sets the cap compared with the default (0.25 MiB unless given): try 0.1 or 1 and
watch the number of buckets and the share of the bytes sent during backward change.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from common import finish, init, title
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # repo root, for model.py
from model import GPT, GPTConfig  # noqa: E402

# Printed before the first table. The stderr lines it explains come before it on a terminal: both
# are printed while the runs execute, the tables only after.
LEGEND = """\
On stderr, above, you may see two notices; neither is a fault:
- "Setting OMP_NUM_THREADS environment variable for each process to be 1" (once): torchrun's own
  (torch/distributed/run.py) whenever OMP_NUM_THREADS is unset and a node runs more than one
  process: one thread per rank so that the ranks do not overload the cores. Setting it yourself
  (OMP_NUM_THREADS=1 torchrun ...) silences it.
- "find_unused_parameters=True was specified in DDP constructor, but did not find any unused
  parameters in the forward pass" (DDP's reducer.cpp, once per rank): true, and on purpose. The
  last two runs pass find_unused_parameters=True because only then does DDP keep the buckets it
  cut from model.parameters() at construction (numbered from the last-defined end) and never
  rebuild them; this GPT does use every parameter. It is a C++ warning, printed once per process:
  Python's warnings filters never see it, so it is explained here rather than filtered.

How to read each table: one table per backward pass, one row per call of the communication hook.
  call           order of the hook calls in this backward (0 = DDP handed this bucket over first)
  bucket         bucket.index(), DDP's number for the bucket; it launches buckets in this order
  KiB            size of the bucket's flat gradient buffer (fp32: 4 bytes per element)
  params         how many parameter tensors (gradients) the bucket holds
  full at k/N    the bucket's last gradient was the k-th of the N to become ready in backward
  sent at k/N    k gradients were ready when DDP handed the bucket to the hook (its all-reduce
                 started then); N/N: after backward, no overlap; sent > full: the bucket was full
                 but waited for a lower-numbered bucket
  first .. last  the bucket's first and last parameter, in the bucket's own order"""

CFG = GPTConfig(
    n_layer=4, n_head=4, n_embd=128, vocab_size=65, block_size=64
)  # the project's default GPT


def record_and_all_reduce(
    log, bucket
):  # no annotations: DDP checks them (mingpt_ddp/parallel/plan.py explains)
    """Comm hook: note what DDP hands over, then average it over ranks like DDP's default hook."""
    grads = bucket.buffer()  # the bucket's gradients, flattened into one tensor
    names = [log["names"][id(p)] for p in bucket.parameters()]
    log["calls"].append(
        {
            "index": bucket.index(),
            "bytes": grads.numel() * grads.element_size(),
            "names": names,
            "full": 1 + max(log["ready"].index(n) for n in names),  # when its last gradient came
            "sent": len(log["ready"]),
        }
    )  # gradients ready now, as DDP launches this bucket
    grads.div_(dist.get_world_size())
    return dist.all_reduce(grads, async_op=True).get_future().then(lambda fut: fut.value()[0])


class EmbeddingsLast(torch.nn.Module):
    """The same GPT with its embeddings listed last in parameters(), as if defined after ln_f."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.body, self.gpt = torch.nn.ModuleList([*gpt.blocks, gpt.ln_f]), gpt

    def forward(self, *args):
        return self.gpt(*args)


def run(wrap=lambda gpt: gpt, **ddp_args) -> list[dict]:
    """Two training steps of the default GPT; each step's hook calls and gradient-ready order."""
    torch.manual_seed(0)  # the same weights on every rank (DDP would broadcast rank 0's anyway)
    gpt = GPT(CFG)
    # named_parameters() lists the tied lm_head.weight once, as wte.weight: DDP reduces it once.
    log = {"names": {id(p): n for n, p in gpt.named_parameters()}, "ready": [], "calls": []}
    for (
        name,
        p,
    ) in gpt.named_parameters():  # runs when p's gradient is complete, before DDP's own hook
        p.register_post_accumulate_grad_hook(lambda p, name=name: log["ready"].append(name))
    ddp = DDP(wrap(gpt), **ddp_args)
    ddp.register_comm_hook(
        log, record_and_all_reduce
    )  # `log` comes back as the hook's first argument
    opt, steps = torch.optim.SGD(gpt.parameters(), lr=0.1), []
    for _ in range(2):
        log["ready"], log["calls"] = [], []
        tokens = torch.randint(
            65, (4, 65), generator=torch.Generator().manual_seed(dist.get_rank())
        )
        opt.zero_grad()
        ddp(tokens[:, :-1], tokens[:, 1:])[1].backward()
        opt.step()
        steps.append({"calls": log["calls"], "ready": log["ready"]})
    return steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record", nargs="?", help="write every bucket's parameter names here (JSON)")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.25,
        help="the cap compared with the default one, in MiB (default 0.25)",
    )
    args = p.parse_args()
    if args.bucket_cap_mb <= 0:
        p.error("--bucket-cap-mb must be positive")
    return args


if __name__ == "__main__":
    args = parse_args()
    cap, capped = args.bucket_cap_mb, f"bucket_cap_mb={args.bucket_cap_mb:g}"
    rank, _ = init()
    runs = {
        "default": run(),
        "cap": run(bucket_cap_mb=cap),  # the cap compared with the default: --bucket-cap-mb
        "25": run(bucket_cap_mb=25),
        # DDP warns that nothing was unused: true here
        "find_unused": run(find_unused_parameters=True),
        "embeddings_last": run(EmbeddingsLast, find_unused_parameters=True, bucket_cap_mb=cap),
    }
    header = (
        f"{'call':>4} {'bucket':>6} {'KiB':>7} {'params':>6} "
        f"{'full at':>8} {'sent at':>8}  first .. last"
    )
    if rank == 0:
        print(LEGEND, flush=True)
    for key, label, its in (
        ("default", "bucket_cap_mb=None (the default)", 2),
        ("cap", capped, 2),
        ("find_unused", "find_unused_parameters=True", 1),
        ("embeddings_last", f"embeddings last, find_unused_parameters=True, {capped}", 1),
    ):
        for it, step in enumerate(runs[key][:its], 1):
            title(f"{label}, iteration {it}\n{header}")
            for i, c in enumerate(step["calls"] if rank == 0 else []):
                n = len(step["ready"])
                print(
                    f"{i:>4} {c['index']:>6} {c['bytes'] / 1024:>7.1f} {len(c['names']):>6} "
                    f"{c['full']:>5}/{n} {c['sent']:>5}/{n}  {c['names'][0]} .. {c['names'][-1]}"
                )
    # every True/False and number below comes from the tables: another torch may print others
    if rank == 0:
        params, flat = (
            [n for n, _ in GPT(CFG).named_parameters()],
            lambda calls: [n for c in calls for n in c["names"]],
        )
        first, default, small = (
            runs["default"][0],
            runs["default"][1]["calls"],
            runs["cap"][1]["calls"],
        )
        total, b0, el = first["calls"][0]["bytes"], default[0], runs["embeddings_last"][0]["calls"]
        fu, fu2 = (step["calls"] for step in runs["find_unused"])
        print(
            f"\n{len(params)} parameter tensors, {total} bytes of fp32 gradients "
            "(tied lm_head.weight counted once)."
        )
        print(
            f"Iteration 1 (default arguments): {len(first['calls'])} bucket(s); "
            f"model.parameters() order: {flat(first['calls']) == params}; "
            f"sent after {first['calls'][0]['sent']}/{len(params)} gradients."
        )
        print(
            f"Iteration 2: buckets follow the order gradients became ready in iteration 1 "
            f"({first['ready'][0]} first, {first['ready'][-1]} last): "
            f"{flat(default) == first['ready']}; {len(default)} buckets at the default cap, "
            f"{len(small)} at {capped}, "
            f"{len(runs['25'][1]['calls'])} if bucket_cap_mb=25 is passed explicitly "
            f"(the 1 MiB first bucket below is only for bucket_cap_mb=None)."
        )
        print(
            f"Bucket 0 holds the last {len(b0['names'])} parameters of model.parameters(): "
            f"{set(b0['names']) == set(params[-len(b0['names']) :])}; "
            f"{b0['bytes']} bytes for a 1 MiB cap ({2**20} bytes): "
            f"a bucket closes at the parameter that reaches its cap ({b0['names'][-1]})."
        )
        print(
            f"find_unused_parameters=True: model.parameters() cut into buckets in reverse order: "
            f"{flat(fu[::-1]) == params}; never rebuilt: {fu == fu2}; "
            f"the last bucket ({fu[-1]['bytes']} bytes) "
            f"holds the first-defined parameters ({fu[-1]['names'][0]} first)."
        )
        in_order = all(
            [c["index"] for c in s["calls"]] == [*range(len(s["calls"]))]
            for r in runs.values()
            for s in r
        )
        print(
            f"Hooks ran in bucket-index order in every run: {in_order}. "
            f"Embeddings listed last: bucket 0 ({', '.join(el[0]['names'][-3:])}) "
            f"was full only at gradient {el[0]['full']}/{len(params)}, "
            f"so {sum(c['sent'] > c['full'] for c in el)} buckets full earlier waited for it."
        )
        for key, calls in (("the default cap", default), (capped, small)):
            # launched before the last gradient was ready
            early = [c for c in calls if c["sent"] < len(params)]
            print(
                f"At {key}: {len(calls)} bucket{'s' * (len(calls) != 1)}, "
                f"{len(early)} sent while backward was still running, "
                f"with {sum(c['bytes'] for c in early) * 100 // total}% of the "
                f"{total / 1e6:.1f} MB; the rest waits for the end of backward."
            )
        if args.record:
            with open(args.record, "w") as f:
                json.dump({"params": params, "bucket_cap_mb": cap, "runs": runs}, f, indent=1)
    finish()
