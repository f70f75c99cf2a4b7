"""The training loop: optimisation, evaluation, logging, and what state goes into a snapshot.

One Trainer runs in every process of the job. Under DDP each process holds a full
copy (replica) of the model, and DistributedDataParallel averages the gradients of
all replicas with an all-reduce during backward, so every replica takes the same
optimizer step and the copies stay identical; under FSDP each holds a shard
(mingpt_ddp/parallel/plan.py does the wrapping). Each rank trains on a different shard of every
global batch, chosen as a DistributedSampler would choose it (mingpt_ddp/corpus/order.py).

Data position is kept as *global samples consumed in this epoch* (sampler.DataCursor):
step by step, the job walks through one seeded permutation of all training windows,
W*B at a time, and rank r takes every W-th of them. Because that position does not
depend on the world size, a snapshot taken with 4 ranks resumes correctly with 2.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from char_dataset import CharDataset
from mingpt_ddp.snapshots.protocol import Checkpointer
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.runtime.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_mean,
    print0,
    warn0,
)
from mingpt_ddp.metrics import MetricsLog, ProgressLine, format_duration
from model import GPT
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.optim import (
    build_optimizers,
    check_muon_supported,
    set_learning_rates,
    state_tensors,
)
from mingpt_ddp.parallel.plan import (
    Plan,
    autocast,
    autocast_attention_fp32,
    bf16_native,
    check_supported,
    grad_scaler,
    local_bytes,
    set_tf32,
    wrap_model,
)
from mingpt_ddp.corpus.order import DataCursor
from mingpt_ddp.snapshots.store import SnapshotStore
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.parallel.deepspeed import ZeroEngine, engine_config


class Trainer:
    def __init__(self, model: GPT, dataset: CharDataset, trainer_cfg: TrainerConfig, optim_cfg: OptimizerConfig,
                 ctx: DistContext, run_config: dict[str, Any], store: SnapshotStore,
                 deepspeed_cfg: DeepSpeedConfig | None = None):
        self.cfg, self.optim_cfg, self.ctx, self.run_config, self.store = trainer_cfg, optim_cfg, ctx, run_config, store
        self.dataset = dataset
        self.device = ctx.device
        c = trainer_cfg
        self.plan = Plan.of(c, ctx.device)  # parallelism and precision ("auto" decided for this device)
        check_supported(self.plan, ctx)
        check_muon_supported(optim_cfg, c.parallel)
        set_tf32(self.plan, self.device)
        self.sharded = c.parallel == "fsdp"  # DTensor shards, saved with DCP
        self.num_params = model.num_params()  # counted now: ZeRO-3 empties the parameters it partitions
        self.raw_model = model.to(self.device)  # the plain module (under FSDP: sharded in place)
        self.model = wrap_model(self.raw_model, self.plan, ctx)  # what training calls
        # Built after wrapping: under FSDP the optimizers must hold the sharded parameters.
        self.optimizers = build_optimizers(self.raw_model, optim_cfg, self.device.type)  # [AdamW] or [AdamW, Muon]
        self.scaler = grad_scaler(self.plan, self.device)
        self.accum_steps = trainer_cfg.grad_accum_steps  # may change on resume at another world size
        self.zero = None  # under parallel=deepspeed, the engine that does backward, clipping and the step
        if c.parallel == "deepspeed":
            ds = deepspeed_cfg or DeepSpeedConfig()
            self.zero = ZeroEngine(self.raw_model, self.optimizers[0], ds, engine_config(
                ds, c.batch_size, self.accum_steps, ctx.world_size, optim_cfg.grad_clip,
                self.plan.amp_dtype if self.plan.use_amp else None), self.device)
            self.model = self.zero.engine
            print0(f"deepspeed | ZeRO-{ds.zero_stage} engine ready in {self.zero.startup_seconds:.1f} s")
        # Under bf16 autocast attention runs in whichever precision is faster on this device: timed once
        # at start by rank 0 (a few ms), so that every rank computes alike.
        g = model.config
        shape = (c.batch_size, g.n_head, g.block_size, g.n_embd // g.n_head)  # (B, nh, T, hs)
        self.attention_fp32, self.attention_choice = all_gather_objects(
            autocast_attention_fp32(self.plan, self.device, shape) if ctx.is_main else None)[0]
        for block in self.raw_model.blocks:
            block.attn.fp32_under_autocast = self.attention_fp32
        # Every rank must run every forward when each holds only part of the parameters.
        self.forward_on_all_ranks = self.sharded or (self.zero is not None and self.zero.cfg.zero_stage == 3)
        self.grad_norm = torch.zeros(())
        if len(dataset.train) < ctx.world_size * c.batch_size:
            raise ConfigError(f"the training region has {len(dataset.train)} windows, fewer than one global batch "
                              f"(batch_size {c.batch_size} x world size {ctx.world_size}); use more text or a "
                              "smaller trainer_config.batch_size")
        self.data_cursor = DataCursor(len(dataset.train), ctx.world_size, ctx.rank, trainer_cfg.seed)
        self.step = 0
        self.data_seconds = 0.0  # time spent preparing batches since the last log line
        self.last_val_loss: float | None = None  # of the latest evaluation; saved, so a rerun knows a target was met
        # Each rank gets its own random stream (dropout must differ across ranks'
        # different samples); all streams follow from the one configured seed.
        torch.manual_seed(trainer_cfg.seed + ctx.rank)
        self.metrics = MetricsLog(trainer_cfg.metrics_file if ctx.is_main else "",
                                  trainer_cfg.tensorboard_dir if ctx.is_main else "", still_owner=store.owns_path)
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT: finish the step, snapshot, exit
        self._stop_requested_at = 0.0  # when (time.monotonic) that signal came
        self._trace = None
        if trainer_cfg.trace_samples_path:
            os.makedirs(trainer_cfg.trace_samples_path, exist_ok=True)
            self._trace = open(os.path.join(trainer_cfg.trace_samples_path, f"rank{ctx.rank}.jsonl"), "a")
        self.checkpointer = Checkpointer(self)  # resume, periodic saves, what a failed save or a signal means

    # ------------------------------------------------------------ snapshot state
    def tensor_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name (the same names with DDP, FSDP or
        neither, so any kind of run can load any kind of snapshot); DTensor shards under FSDP."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)  # one dict for all optimizers
        return {"model": model_sd, "optimizer": optim_sd}

    def meta_state(self) -> dict[str, Any]:
        """Everything else needed to continue exactly; collective (gathers every rank's RNG state)."""
        rng = all_gather_objects({
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        })
        return {
            "format_version": 3,  # 3: data position as a DataCursor state
            "step": self.step, "data_cursor": self.data_cursor.state_dict(),
            "val_loss": self.last_val_loss,
            "world_size": self.ctx.world_size,
            "global_batch": self.cfg.batch_size * self.ctx.world_size * self.accum_steps,
            "scaler": self.scaler.state_dict(),  # fp16 loss scale and its growth tracker
            "deepspeed": {"zero_stage": self.zero.cfg.zero_stage} if self.zero else None,
            "rng": rng,
            "config": self.run_config,
            "vocab": self.dataset.tokenizer.chars,
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole snapshot as one dict (what a single-file snapshot holds)."""
        return {**self.meta_state(), **self.tensor_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Everything a snapshot restores; model and optimizer only if given (DeepSpeed loads its own)."""
        if "model" in state:
            # A single-file snapshot holds full tensors; a sharded one was loaded into our own layout.
            full = self.sharded and not isinstance(next(iter(state["model"].values())), DTensor)
            set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=full))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self._load_data_cursor(state)
        self.last_val_loss = state.get("val_loss")
        if state["world_size"] == self.ctx.world_size:
            # Same world size: every rank continues its own random stream exactly.
            rng = state["rng"][self.ctx.rank]
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        else:
            # Ranks no longer map one-to-one onto the saved streams: start new ones,
            # still a function of the seed, and of the step so they do not replay step 0's.
            torch.manual_seed(self.cfg.seed + 100_003 * self.step + self.ctx.rank)

    def _load_data_cursor(self, state: dict[str, Any]) -> None:
        cursor = state.get("data_cursor") or {"epoch": state["epoch"], "samples_consumed": state["samples_consumed"]}
        if cursor.get("order") != DataCursor.ORDER:  # a snapshot from before the order was a Feistel permutation
            warn0(f"the snapshot walked epoch {cursor['epoch']} in another order; the rest of that epoch follows this "
                  "version's order, so some of its windows may repeat or be skipped (later epochs are exact)")
        self.data_cursor.load_state_dict(cursor)

    # --------------------------------------------------------------------- data
    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.data_cursor.next_starts(self.cfg.batch_size)  # (B,) this rank's window starts
        if self._trace is not None:
            self._trace.write(json.dumps({"step": self.step + 1, "epoch": self.data_cursor.epoch,
                                          "starts": starts.tolist()}) + "\n")
            self._trace.flush()
        return self._to_device(self.dataset.train.ids(starts))

    def _to_device(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T+1) ids read from the token file -> inputs x and targets y, (B, T) int64 on the device.

        For a GPU the compact ids (1-2 bytes each, not int64's 8) are copied from page-locked
        (pinned) host memory: the copy is then a DMA that runs asynchronously, while from
        ordinary pageable memory it is staged through a pinned buffer first and can stall."""
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        ids = ids.long()  # (B, T+1)
        return ids[:, :-1], ids[:, 1:]

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over a fixed, evenly spaced set of windows, averaged over all ranks.
        Its cost depends on eval_iters, batch size and world size, not on the corpus."""
        B, W, n_iters = self.cfg.batch_size, self.ctx.world_size, self.cfg.eval_iters
        starts = self.dataset.val.evenly_spaced(n_iters * B * W)[self.ctx.rank :: W]  # this rank's share
        self.raw_model.eval()  # no dropout; no gradients, so DDP's hooks are not needed (FSDP's gather still runs)
        total = torch.zeros((), device=self.device)
        for i in range(n_iters):
            x, y = self._to_device(self.dataset.val.ids(starts[i * B : (i + 1) * B]))
            with self._autocast():
                total += self.raw_model(x, y)[1]
        self.raw_model.train()
        return all_reduce_mean(total / n_iters).item()

    def _sample(self) -> str:
        tok = self.dataset.tokenizer
        prompt = tok.encode("\n" if "\n" in tok.stoi else tok.chars[0])[None].to(self.device)  # (1, 1)
        gen = torch.Generator(self.device).manual_seed(self.cfg.seed)  # own generator: training RNG untouched
        out = self.raw_model.generate(prompt, self.cfg.sample_chars, temperature=0.8, generator=gen)
        return tok.decode(out[0, 1:])

    def _precision(self) -> str:
        """How the model computes, in words, for the start-up line (the job line says why)."""
        plan = self.plan
        if not plan.use_amp:
            return "fp32 (TF32 matmuls)" if self.device.type == "cuda" and plan.tf32 else "fp32"
        words = f"{plan.amp_dtype} parameters (FSDP mixed precision)" if self.sharded else \
            f"{plan.amp_dtype} parameters, fp32 master weights (DeepSpeed)" if self.zero else f"{plan.amp_dtype} autocast"
        if plan.amp_dtype == "bf16":  # whether the hardware has bf16 units decides if bf16 pays off
            words += f" ({bf16_native(self.device)[1]})" + (f", {self.attention_choice}" if self.attention_choice else "")
        return words + (" + GradScaler" if self.scaler.is_enabled() else "")

    def _autocast(self):
        return autocast(self.plan, self.device)

    def _gradient_sync(self, sync: bool):
        """Gradient accumulation: communicate gradients only on the last micro-step; before it they
        just accumulate locally (DDP's no_sync, FSDP's set_requires_gradient_sync)."""
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)
        if sync or not isinstance(self.model, DDP):
            return nullcontext()
        return self.model.no_sync()

    def train_step(self) -> torch.Tensor:
        """One optimizer step over grad_accum_steps micro-batches; returns the mean loss (on device)."""
        set_learning_rates(self.optimizers, self.optim_cfg, self.step, self.cfg.max_steps)
        n_micro = self.accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(n_micro):
            t0 = time.perf_counter()
            x, y = self._next_batch()
            self.data_seconds += time.perf_counter() - t0
            with self._gradient_sync(micro == n_micro - 1), self._autocast():
                _, loss = self.model(x, y)
            if self.zero:  # the engine scales for accumulation, and steps after the last micro-step
                self.zero.backward(loss)
            else:
                self.scaler.scale(loss / n_micro).backward()  # scale: a no-op unless fp16
            loss_sum += loss.detach()
        self.grad_norm = self.zero.grad_norm() if self.zero else self._clip_and_step()
        self.step += 1
        return loss_sum / n_micro

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the gradients and update the parameters; returns the gradient norm before clipping."""
        # Unscale before clipping, so the clip threshold applies to the true gradients.
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        # The norm over all parameters (all shards, under FSDP); inf = measure without clipping.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip or math.inf)
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            optimizer.zero_grad(set_to_none=True)  # free gradient memory instead of writing zeros
        self.scaler.update()
        return norm

    def _target_reached(self) -> bool:
        """The latest evaluation (this run's, or the snapshot's) met trainer_config.target_val_loss."""
        target = self.cfg.target_val_loss
        return bool(target) and self.last_val_loss is not None and self.last_val_loss <= target

    def _grad_norm_value(self) -> float:
        norm = self.grad_norm
        return float((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())

    def _request_stop(self, signum: int, frame) -> None:
        if self.stop_signal is not None:
            # One request often arrives twice: SLURM signals every process of the job step and
            # torchrun forwards the same signal to its workers; Ctrl-C reaches the whole process
            # group. Only a signal well after the first (a second Ctrl-C) means "stop right now".
            if time.monotonic() - self._stop_requested_at < DUPLICATE_SIGNAL_WINDOW_S:
                return
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.stop_signal = signum
        self._stop_requested_at = time.monotonic()
        # The loop will stop at the end of this step. A rank stuck somewhere (a hung
        # filesystem, a deadlock) never gets there: give up after the collective
        # timeout so the launcher can restart the group without waiting longer.
        timer = threading.Timer(self.cfg.collective_timeout_s, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()

    def train(self) -> bool:
        """Train to max_steps; returns False if stopped early by SIGTERM/SIGINT (after a snapshot)."""
        # SIGTERM is what SLURM, Kubernetes and torchrun send before killing a job:
        # finish the step on every rank, snapshot, exit, instead of losing the work since the last save.
        # Under submitit (Hydra's submitit launcher), its handler for the preemption signal requeues
        # the job: it is called once this step is snapshotted, so the requeued job resumes from it.
        handover = submitit_preemption()
        stops = (signal.SIGTERM, signal.SIGINT) + ((handover[0],) if handover else ())
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in stops}
        try:
            finished = self._train_loop()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self._trace is not None:
                self._trace.close()
        if self.ctx.is_main:
            self.store.wait()  # the final save is on disk before the process exits
        if handover and self.stop_signal == handover[0]:
            print0("preempted | snapshot saved; submitit requeues this job, which resumes from it")
            handover[1](self.stop_signal, None)  # scontrol requeue, then exit
        return finished

    # ------------------------------------------------------------------ the loop
    def _train_loop(self) -> bool:
        """Train to max_steps (or the target loss); False if a stop signal ended it early."""
        self._announce()
        if self._nothing_to_do():
            return True
        progress = ProgressLine(self.cfg.max_steps, enabled=self.ctx.is_main)
        window, t_start = _LogWindow(self.step, self.device), time.perf_counter()
        while self.step < self.cfg.max_steps:
            window.add(self.train_step())
            if self.step == window.start_step + 1:  # AdamW creates its state at the first step
                self._report_optimizer_memory()
            progress.update(self.step)
            last = self.step == self.cfg.max_steps
            evaluate = self.step % self.cfg.eval_every == 0 or last
            if self.step % self.cfg.log_every == 0 or evaluate:
                progress.clear()
                last = self._log(window, t_start, evaluate) or last  # True: the target loss was reached
            stop = self.checkpointer.save_and_vote(last)
            if stop:
                progress.clear()
                self.checkpointer.stop_for(stop)
                return False
            if last:
                break
        progress.clear()
        print0(f"done | step {self.step} | {format_duration(time.perf_counter() - t_start)} wall time this run | "
               f"peak memory per rank {self._peak_memory()}")
        return True

    def _announce(self) -> None:
        """The start-up line: what is about to train, how, and for how long."""
        cfg, W = self.cfg, self.ctx.world_size
        tokens_per_step = cfg.batch_size * self.raw_model.config.block_size * W * self.accum_steps
        epochs = cfg.max_steps * tokens_per_step / self.raw_model.config.block_size / len(self.dataset.train)
        mode = f"{cfg.parallel} (gradients via rank 0)" if cfg.grad_reduce == "via_rank0" else cfg.parallel
        if self.zero:
            mode = f"deepspeed ZeRO-{self.zero.cfg.zero_stage}" + \
                (" + optimizer offload" if self.zero.cfg.offload_optimizer else "") + \
                (" + parameter offload" if self.zero.cfg.offload_params else "")
        print0(f"train | {self.num_params / 1e6:.2f}M parameters | {mode} | {self._precision()}"
               f"{' + compile' if cfg.compile else ''} | world size {W} | "
               f"global batch {cfg.batch_size * W * self.accum_steps} windows = {tokens_per_step} tokens | "
               f"steps {self.step}->{cfg.max_steps} (~{epochs:.2f} epochs)")

    def _report_optimizer_memory(self) -> None:
        """One line: the optimizer state each rank holds, as a mean over the ranks. Under DDP every
        rank holds all of it; ZeRO (any stage) and FSDP split it, 1/N per rank."""
        optimizers = [self.zero.engine.optimizer.optimizer] if self.zero else self.optimizers  # ZeRO's wraps torch's
        mean = all_reduce_mean(torch.tensor(float(local_bytes(state_tensors(optimizers))), device=self.device)).item()
        what = "AdamW's 2 moments" + (" + Muon's momentum" if len(optimizers) > 1 else "")
        print0(f"memory | optimizer state {mean / 1e6:.3f} MB per rank ({what}, mean over ranks)")

    def _peak_memory(self) -> str:
        """The most memory any rank has held: its process's peak resident size (and on GPUs, the peak
        of tensors on its GPU). Collective: every rank reports, the largest is printed."""
        host_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        gpu_mb = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        host_mb, gpu_mb = (max(values) for values in zip(*all_gather_objects((host_mb, gpu_mb))))
        return f"{host_mb:.0f} MiB host" + (f", {gpu_mb:.0f} MiB GPU" if gpu_mb else "") + " (largest rank)"

    def _nothing_to_do(self) -> bool:
        """A rerun of a finished run (target met, or max_steps reached) trains nothing."""
        if self._target_reached():
            print0(f"train | snapshot's val loss {self.last_val_loss:.4f} already meets trainer_config.target_val_loss "
                   f"{self.cfg.target_val_loss}; nothing to do")
            return True
        if self.step >= self.cfg.max_steps:
            print0(f"train | snapshot is already at step {self.step} >= max_steps {self.cfg.max_steps}; nothing to do "
                   f"(raise trainer_config.max_steps, or use another trainer_config.run_dir for a new run)")
            return True
        return False

    def _log(self, window: _LogWindow, t_start: float, evaluate: bool) -> bool:
        """One log line (and metrics record) for the steps since the last; with evaluate, the validation
        loss and a sample too. Returns whether the target loss was reached."""
        cfg, step = self.cfg, self.step
        tokens_per_step = cfg.batch_size * self.raw_model.config.block_size * self.ctx.world_size * self.accum_steps
        # .item() waits for the device: only on log steps, never every step. The loss is averaged over ranks.
        train_loss = all_reduce_mean(window.loss_sum / (step - window.step)).item()
        now = time.perf_counter()
        dt_step = (now - window.time) / (step - window.step)
        eta = (now - t_start) / (step - window.start_step) * (cfg.max_steps - step)
        record = {"step": step, "epoch": self.data_cursor.epoch, "train_loss": round(train_loss, 6),
                  "lr": self.optimizers[0].param_groups[0]["lr"], "tokens_per_sec": round(tokens_per_step / dt_step, 1),
                  "ms_per_step": round(1e3 * dt_step, 2), "grad_norm": round(self._grad_norm_value(), 4),
                  "data_ms": round(1e3 * self.data_seconds / (step - window.step), 3)}
        print0(f"step {step:>6}/{cfg.max_steps} | epoch {self.data_cursor.epoch} | loss {train_loss:.4f} | "
               f"lr {record['lr']:.2e} | {record['tokens_per_sec'] / 1e3:.1f}k tok/s | "
               f"{record['ms_per_step']:.1f} ms/step | ETA {format_duration(eta)}")
        reached = False
        if evaluate:
            record["val_loss"] = self.last_val_loss = round(self.evaluate(), 6)
            line = f"eval | step {step} | val loss {record['val_loss']:.4f}"
            # Under FSDP every rank must take part in each forward (they all-gather
            # parameters), so all ranks generate the same sample; rank 0 prints it.
            if cfg.sample_chars and (self.ctx.is_main or self.forward_on_all_ranks):
                record["sample"] = self._sample()
                line += f" | sample: {record['sample']!r}"
            print0(line)
            if reached := self._target_reached():  # every rank has the same all-reduced loss: all stop here
                print0(f"target | val loss {record['val_loss']:.4f} <= trainer_config.target_val_loss "
                       f"{cfg.target_val_loss} at step {step} | stopping")
        self.metrics.write(record)
        window.reset(step)
        self.data_seconds = 0.0
        return reached


def submitit_preemption() -> tuple[int, Callable] | None:
    """submitit's preemption signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise) and its
    handler, when this process is a submitit job; None otherwise. The handler requeues the job and
    exits; it saves nothing of the job's own, which is why the Trainer snapshots first."""
    if "SUBMITIT_FOLDER" not in os.environ:
        return None
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    handler = signal.getsignal(sig) if sig is not None else None
    return (sig, handler) if callable(handler) else None


# A repeat of a stop signal within this many seconds is the same request delivered twice (by SLURM
# and torchrun, or to the whole process group); a later one, like a second Ctrl-C, stops at once.
DUPLICATE_SIGNAL_WINDOW_S = 1.0


class _LogWindow:
    """The steps since the last log line: where they began, when, and their summed loss (on the device)."""

    def __init__(self, step: int, device: torch.device):
        self.start_step, self.device = step, device
        self.reset(step)

    def reset(self, step: int) -> None:
        self.step, self.time = step, time.perf_counter()
        self.loss_sum = torch.zeros((), device=self.device)

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
