"""The trainer process: collect B groups, one decoupled-PPO step, publish version+1, repeat.

Every rank runs this loop. Rank 0 also owns the replay buffer (fed by a CURVE-secured PULL
socket announced in `<exp>/services/trainer.json`), talks to the controller, and writes
weights, metrics and the loop part of checkpoints. The step's batch travels from rank 0 to the
other ranks as one broadcast; from it every rank derives the same plan (see batch.py).

Order within a step, and why:
  1. take the B oldest complete groups (staleness measured against the current version);
  2. recompute proximal log-probs for the whole batch with the parameters at the start of the
     step, before any update (so every minibatch's trust region is around the same policy);
  3. ppo_n_minibatches optimizer updates;
  4. version += 1, publish the weights (trainer/weights/), tell the controller (the method's
     message: weights_on_disk, weights_broadcast) and wait for its
     ack (or let it run in the background and wait before the next publish);
  5. checkpoint every `checkpoint_every` steps, and on SIGTERM.
A crash between 4 and 5 re-trains the step after resume and republishes the same version with
the same numbers (training is deterministic given the checkpoint). Trajectories that arrived
after the last checkpoint are not lost: each one is appended to a log (wal.py) that resume
replays on top of the checkpoint's buffer, before the worker gets its receipt (intake.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.services.protocol import (
    ExpDir,
    GroupsDropped,
    MetricsWriter,
    PhaseTimer,
    Shutdown,
    TrainerResumed,
    Trajectory,
    TrajectorySink,
    collectives,
    load_keys,
    publish_service,
)
from tandem.services.protocol.trackers import TrackerFollower, start_trackers
from tandem.trainer import build_backend, checkpoint, recompute
from tandem.trainer import objective_step as objective
from tandem.trainer.announcements import Announcements, coalesces_versions
from tandem.trainer.backend import TrainBackend
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import ReplayBuffer
from tandem.trainer.controller_link import ControllerLink
from tandem.trainer.distributed import init_distributed
from tandem.trainer.elastic_cpus import TrainerCpus
from tandem.trainer.intake import Intake
from tandem.trainer.learning_signals import LearningSignals
from tandem.trainer.samples import SampleLog
from tandem.trainer.step_fields import groups_fields
from tandem.trainer.trajectory_check import TrajectoryCheck, model_vocab_size, replay_routing
from tandem.trainer.wal import TrajectoryLog, delete_wals, wal_path, wal_seqs
from tandem.trainer.wal import replay as wal_replay
from tandem.trainer.weights import BackgroundCall, build_publisher
from tandem.trainer.weights.disk import keep_final

log = logging.getLogger(__name__)

STAT_SUMS = ("loss", "clipped", "imp_weight_sum", "capped", "ratio_sum", "valid", "entropy_sum",
             *objective.EXTRA_SUMS)
STAT_MAXES = ("imp_weight_max", *objective.EXTRA_MAXES)


class Trainer:
    def __init__(self, cfg, exp: ExpDir, resume: bool = False, backend: TrainBackend | None = None):
        """`cfg` is the experiment config (sections experiment, trainer, gen are read)."""
        self.cfg, self.tcfg, self.exp = cfg, cfg.trainer, exp
        if not resume and checkpoint.latest(exp.checkpoints) is not None:
            raise SystemExit(f"tandem trainer: {exp.checkpoints} already holds checkpoints; pass "
                             f"--resume to continue that run, or remove them to start over")
        init_distributed()
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.backend = backend or build_backend(self.tcfg, cfg.experiment.model, cfg.experiment.seed,
                                                recompute.pipeline_micro_batches(cfg, world))
        self.rank = self.backend.rank
        self.version = 0
        self.nonfinite_steps = 0    # steps stopped by a NaN/inf loss term (this process)
        vocab = model_vocab_size(cfg.experiment.model)
        self.buffer = ReplayBuffer(vocab, replay_routing(self.tcfg, cfg.experiment.model))
        self.staleness = Counter()          # step - admit_version of every trained group
        self.token_staleness = Counter()    # step - min(output_versions) of every trained group
        self.shutdown = Shutdown()
        self.settings = objective.settings_from_config(self.tcfg)
        self.backend.entropy_grad = self.settings.entropy_coef > 0
        self.metrics = MetricsWriter(exp, "trainer", self.rank) if self.rank == 0 else None
        if self.metrics:   # what the trainer chose at its start (trainer/recompute.py), and why
            self.metrics.log(event="trainer_start", backend=self.tcfg.backend, resumed=resume,
                             world_size=getattr(self.backend, "world_size", 1), **recompute.start_fields(self.backend))
        # Rank 0's watch on whether the run learns (trainer/learning_signals.py), and its samples.
        self.signals = LearningSignals(self.tcfg.signals, self.tcfg.groups_per_step, self.metrics,
                                       getattr(getattr(cfg, "rollout", None), "filter_all_equal", False))
        self.samples = SampleLog(self.tcfg.samples, cfg.experiment.model, cfg.experiment.seed, self.metrics)
        # Announcements not answered yet; with coalesced versions (announcements.py) several.
        self.announcements = Announcements(coalesces_versions(
            getattr(getattr(cfg, "controller", None), "interruptible", True), self.tcfg.weight_sync,
            self.tcfg.wait_for_ack), self.tcfg.keep_weights, self._await)
        self.publisher = build_publisher(self.tcfg, exp.weights, self._receiver_ranks())
        self._step_staleness: Counter = Counter()
        self._step_token_staleness: Counter = Counter()
        self._step_dropped: list[str] = []
        self._step_ids: dict = {}
        self._last_checkpoint = -1
        # launcher.elastic: the CPU set the launcher gives this trainer, followed at each step boundary.
        elastic = getattr(getattr(cfg, "launcher", None), "elastic", False) is True
        self.cpus = TrainerCpus(exp, self.metrics) if elastic else None
        self.trackers: TrackerFollower | None = None   # TensorBoard/W&B, fed from metrics.jsonl
        self._wal_seq = 0
        self._resumed = resume
        if resume:
            self._resume()
        if self.rank == 0:
            wal = self._open_wal(replay_existing=resume)
            self.keys = load_keys(exp.keys, "trainer")
            self.intake = Intake(TrajectorySink(self.keys, self.tcfg.host, self.tcfg.port, name="trainer"), wal,
                                 TrajectoryCheck(exp.keys, vocab))
            self.controller = ControllerLink(exp, self.keys, self.shutdown, self.tcfg.ack_timeout_s)
            self.announcements.new_link = lambda: ControllerLink(exp, self.keys, self.shutdown,
                                                                 self.tcfg.ack_timeout_s)

    # ---- main loop ----------------------------------------------------------------------------
    def run(self, install_signals: bool = True) -> int:
        if install_signals:
            self.shutdown.install()
        try:
            if self.rank == 0:   # one process writes the trackers; its thread never blocks this one
                self.trackers = start_trackers(self.cfg, self.exp)
            if self._resumed:
                self._rejoin()
            if self.rank == 0:
                # Ready only now: rollout workers start on this, after a resume has set the present.
                publish_service(self.exp, "trainer", {"trajectory_address": self.intake.sink.address,
                                                      "version": self.version})
                log.info("trainer listening for trajectories on %s (version %d)", self.intake.sink.address,
                         self.version)
            while self.version < self.tcfg.total_steps:
                if self.cpus:
                    self.cpus.check()
                timer = PhaseTimer()
                with timer.phase("wait"):
                    batch = self._broadcast(self._collect() if self.rank == 0 else None)
                if batch is None:
                    break  # shutdown requested while waiting for data
                # The step's own cost, without waiting for data or for the weight sync: what the
                # simulator's trainer cost is calibrated on.
                with timer.phase("train_step"):
                    record = self.train_step(batch)
                self.version += 1
                # Publishing + the controller's pause/update/continue of every server.
                with timer.phase("weight_sync"):
                    record.update(self._publish())
                self.record_step(record | timer.fields(total="step_s"))
                # After its step's record: killed in between, the step is redone from the previous
                # checkpoint and recorded again; the other order could leave a checkpoint standing
                # for a step that no record (and so no audit) ever shows.
                if self.tcfg.checkpoint_every and self.version % self.tcfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if self._stop_requested():
                    break
            self.announcements.wait_all()
            if self.version >= self.tcfg.total_steps:   # the final policy stays on disk (tandem export)
                keep_final(self.backend, self.exp.weights, self.version, self.tcfg.keep_weights)
            if self._last_checkpoint != self.version or self._stop_requested():
                self.save_checkpoint()
        finally:
            try:
                self.close()
            finally:
                if self.trackers:   # after the last records: forward them, flush, close
                    self.trackers.stop()
        return 0

    def record_step(self, record: dict) -> None:
        if self.rank == 0:
            self.metrics.log(event="step", step=self.version, **record, **self._step_ids)
            self.signals.flush()   # the step's warnings (no reward signal) after its record
            self._step_dropped = []   # recorded; drops from now on go in the next record
            log.info("step %d: loss %.4g clip %.3f grad_norm %.3g tokens/s %.0f", self.version, record["loss"],
                     record["clip_fraction"], record["grad_norm"], record["tokens_per_s"])

    def _stop_requested(self) -> bool:
        stop = self.shutdown.requested
        if dist.is_initialized():
            flag = collectives.all_reduce(torch.tensor([int(stop)]), op=collectives.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _collect(self) -> StepBatch | None:
        """Receive trajectories until B usable groups are ready (rank 0); None on shutdown."""
        t = self.tcfg
        while True:
            self._release_refused()
            result = self.buffer.take(t.groups_per_step, self.version, t.max_staleness, t.stale_policy)
            if result.dropped:  # give their admission slots back, or the run would slowly stall
                ids = [g.group_id for g in result.dropped]
                self._step_dropped += ids
                reason = f"staler than eta={t.max_staleness}"
                self.metrics.log(event="thrown_away", group_ids=ids, reason=reason)
                self.controller.request(GroupsDropped(ids, reason), "groups_dropped")
            if result.groups:
                break
            if self.shutdown.requested or self.signals.should_stop(self.version, self.controller):
                return None   # asked to stop, or trainer.signals' cap on groups rejected in a row
            if self.cpus:   # waiting for data is a step boundary too
                self.cpus.check()
            self._drain(first_timeout_s=0.2)
        self._step_staleness = Counter(self.version - g.admit_version for g in result.groups)
        self._step_token_staleness = Counter(self.version - g.min_output_version() for g in result.groups)
        self.staleness.update(self._step_staleness)
        self.token_staleness.update(self._step_token_staleness)
        # Which groups this step trained and dropped: `tandem audit` follows every group by id.
        self._step_ids = {**groups_fields(result.groups), "dropped_ids": self._step_dropped,
                          **self.signals.step_fields(result.groups, self.version + 1, self.controller)}
        self.samples.log(self.version + 1, result.groups)
        return StepBatch.from_groups(result.groups)

    def _release_refused(self) -> None:
        """Groups the buffer refused (an invalid trajectory) will never train: give their
        admission slots back, or capacity shrinks by one per refusal until the run stalls."""
        refused = self.buffer.take_refused()
        self._step_dropped += list(refused)
        for why, ids in self._record_refused(refused).items():
            self.controller.request(GroupsDropped(ids, f"refused: {why}"[:500]), "groups_dropped")

    def _record_refused(self, refused: dict[str, str]) -> dict[str, list[str]]:
        """`thrown_away` records of refused groups (by reason) and of the samples the intake refused
        alone, before any group, since the last call: `tandem audit` names each with its reason."""
        by_reason = _by_reason(refused)
        for why, ids in by_reason.items():
            self.metrics.log(event="thrown_away", group_ids=ids, reason=f"refused: {why}"[:500])
        samples, count = self.intake.take_refused()
        if count:
            self.metrics.log(event="thrown_away", samples=samples, samples_count=count)
        return by_reason

    def _drain(self, first_timeout_s: float) -> None:
        for body in self.intake.take(first_timeout_s):
            if isinstance(body, Trajectory):
                self.buffer.add(body)
            else:
                self.buffer.counters["rejected_not_trajectory"] += 1
                log.warning("ignored a %s message on the trajectory socket", type(body).__name__)

    def _broadcast(self, batch):
        if not dist.is_initialized():
            return batch
        box = [batch]
        collectives.broadcast_object_list(box, src=0)
        return box[0]

    # ---- one global step ----------------------------------------------------------------------
    def train_step(self, batch: StepBatch) -> dict:
        """Proximal recompute (unless skipped) + ppo_n_minibatches updates on every rank; returns
        the metrics."""
        t, be = self.tcfg, self.backend
        t0 = time.perf_counter()
        plan = plan_step(batch, t.ppo_n_minibatches, t.max_tokens_per_mb, be.dp_size, be.dp_rank,
                         t.group_baseline, t.normalize_advantages, objective.shaping_from_config(t))
        objective.start_of_step(plan, be, t.temperature, self.settings)
        t1 = time.perf_counter()
        totals = dict.fromkeys(STAT_SUMS, 0.0) | dict.fromkeys(STAT_MAXES, 0.0)
        grad_norms, skipped, stop, lr = [], 0, None, None
        for i, mp in enumerate(plan.minibatches):
            loss_fn = objective.make_loss_fn(self.settings, mp, i, len(plan.minibatches), self.version)
            result = be.train_step(mp.micro_batches, loss_fn, t.temperature)
            grad_norms.append(result.grad_norm)
            lr = result.lr   # the schedule's rate of the step's last update
            skipped += not result.applied
            for k, v in result.stats.items():
                if k in STAT_MAXES:
                    totals[k] = max(totals[k], v)
                elif k in totals:
                    totals[k] += v
            if result.nonfinite:   # every rank sees the same dict: all stop here together
                stop = objective.NonFiniteStop(self.version, i, len(plan.minibatches), result.nonfinite)
                log.error("%s", stop)
                self.nonfinite_steps += 1
                break
        totals = self._reduce_stats(totals)
        t2 = time.perf_counter()
        valid = max(totals["valid"], 1.0)
        n_tokens = sum(batch.seq_len(i) for i in range(len(batch)))
        return {
            "version_trained": self.version,
            "loss": totals["loss"] / valid,
            "clip_fraction": totals["clipped"] / valid,
            "imp_weight_mean": totals["imp_weight_sum"] / valid,
            "imp_weight_max": totals["imp_weight_max"],
            "masked_fraction": totals["capped"] / valid,
            "ratio_mean": totals["ratio_sum"] / valid,
            "entropy": totals["entropy_sum"] / valid,
            "grad_norm": max(grad_norms) if grad_norms else 0.0, "lr": lr,
            "updates_skipped": skipped,
            "reward_mean": float(sum(batch.rewards) / max(len(batch), 1)),
            "n_seqs": len(batch), "n_groups": batch.n_groups, "valid_tokens": int(totals["valid"]),
            "train_tokens": n_tokens, "train_world_size": be.world_size, "too_long": plan.too_long,
            "micro_batches": sum(len(m.micro_batches) for m in plan.minibatches),
            "prox_s": t1 - t0, "train_s": t2 - t1, "tokens_per_s": n_tokens / max(t2 - t0, 1e-9),
            # This step's groups by staleness (version - admit_version), and since the run began.
            "staleness_hist": _hist(self._step_staleness),
            "token_staleness_hist": _hist(self._step_token_staleness),
            "staleness_hist_total": _hist(self.staleness),
            "token_staleness_hist_total": _hist(self.token_staleness),
            "buffer_ready": self.buffer.n_ready if self.rank == 0 else 0,
            "buffer_partial": self.buffer.n_partial if self.rank == 0 else 0,
            **({f"buffer_{k}": v for k, v in self.buffer.counters.items()} if self.rank == 0 else {}),
            **objective.step_metrics(totals, len(plan.minibatches), self.settings), **plan.shaping,
            **objective.nonfinite_fields(stop, self.nonfinite_steps),
            **be.step_metrics(),   # the backend's own (MoE routing on Megatron), collective
        }

    def _reduce_stats(self, totals: dict) -> dict:
        if not dist.is_initialized():
            return totals
        sums = torch.tensor([totals[k] for k in STAT_SUMS], dtype=torch.float64)
        maxes = torch.tensor([totals[k] for k in STAT_MAXES], dtype=torch.float64)
        # On the CPU here; `collectives` moves them to the group's device (CUDA under NCCL).
        collectives.all_reduce(sums)
        collectives.all_reduce(maxes, op=collectives.ReduceOp.MAX)
        return dict(zip(STAT_SUMS, sums.tolist(), strict=True)) | dict(zip(STAT_MAXES, maxes.tolist(), strict=True))

    # ---- weights ------------------------------------------------------------------------------
    def _publish(self) -> dict:
        """Publish self.version (with trainer.weight_sync's publisher) and notify the controller;
        returns phase timings."""
        self.announcements.make_room(self.version)
        t_start = time.perf_counter()
        publication = self.publisher.publish(self.backend, self.version)
        timings = dict(publication.timings)
        if self.rank != 0:
            return timings
        # The transfer (a broadcast) runs while the controller has the servers receive it.
        sender = BackgroundCall(publication.transfer, "weights transfer") if publication.transfer else None
        # What the trainer spends making the version available, before any server loads it.
        timings["weight_publish_s"] = time.perf_counter() - t_start
        notify = self.announcements.send(self.version, publication.message, sender)
        if self.tcfg.wait_for_ack:
            timings.update(self._await(notify))
        else:
            self.announcements.add(self.version, notify)
        timings.update(self.announcements.superseded_since_last())
        return timings

    def _await(self, call: BackgroundCall) -> dict:
        """The call's result; on SIGTERM stop waiting (the checkpoint matters more than the ack)."""
        while True:
            try:
                return call.result(timeout_s=0.5)
            except TimeoutError:
                if self.shutdown.requested:
                    log.warning("shutting down without the controller's ack")
                    return {"ack_ok": False}

    def _rejoin(self) -> None:
        """A resumed trainer is the authority on the run's present. It tells the controller its
        version and what it holds, then publishes its checkpoint's weights again as that same
        version: a fresh server, or one that an abandoned launch moved past the checkpoint, then
        generates with the policy training continues from (and the publisher deletes the
        abandoned versions' weights)."""
        if self.rank == 0:
            discarded = self.buffer.discard_future(self.version)
            if discarded:   # recorded as dropped: the audit finds every group's end (launcher/audit.py)
                log.warning("discarded %d groups admitted after version %d by an abandoned launch",
                            len(discarded), self.version)
                self.metrics.log(event="discarded_future", version=self.version, dropped_ids=discarded)
            self._announce_resume()
        if self.version > 0:
            self._publish()
            self.announcements.wait_all()

    def _announce_resume(self) -> None:
        """Tell the controller what a resumed trainer really holds, before taking data: its
        version and the groups that hold an admission slot (trained + complete in the buffer;
        not the dropped or refused ones, whose slots were given back), so admission counts from
        the trainer's truth rather than from the crashed process's."""
        held = self.buffer.n_trained + self.buffer.n_ready
        reply = self.controller.request(TrainerResumed(version=self.version, groups_held=held),
                                        "trainer_resumed")
        log.info("announced resume at version %d holding %d groups: %s", self.version, held, reply)

    def _receiver_ranks(self) -> int:
        """Ranks that receive a weight broadcast: every TP rank of every generation server
        (SGLang joins each at rank_offset + tp_rank; the controller assigns the offsets). An
        embedded server is one process: one rank whatever gen.tp_size says."""
        gen = getattr(self.cfg, "gen", None)
        tp = int(getattr(gen, "tp_size", 1)) if getattr(gen, "backend", "embedded") == "sglang" else 1
        return int(getattr(gen, "num_servers", 1)) * tp

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Every checkpoint, the one at a stop (SIGTERM, the run's end) too, with a `checkpoint` record."""
        t0, loop_state = time.perf_counter(), None
        if self.rank == 0:
            with self.intake.paused():
                self._drain(first_timeout_s=0)  # whatever arrived (and was logged) joins the snapshot
                loop_state = {"version": self.version, "buffer": self.buffer.state_dict(),
                              "staleness": dict(self.staleness), "token_staleness": dict(self.token_staleness),
                              "wal_seq": self._wal_seq + 1, "rejected_seen": self.signals.rejected_seen}
                # Arrivals from now on go to the next log; resume replays it with this checkpoint
                # (or, if this one is never written, with the previous one: see _open_wal).
                self.intake.wal.close()
                self._wal_seq += 1
                self.intake.wal = TrajectoryLog(wal_path(self.exp.checkpoints, self._wal_seq), truncate=True)
        be = self.backend
        if be.sharded_checkpoint:  # Megatron: dist checkpointing, reshardable on load
            checkpoint.save(self.exp.checkpoints, self.version, self.rank, {}, loop_state,
                            self.tcfg.keep_checkpoints, write_sharded=be.save_checkpoint)
        else:
            checkpoint.save(self.exp.checkpoints, self.version, self.rank, {"backend": be.state_dict()},
                            loop_state, self.tcfg.keep_checkpoints)
        self._last_checkpoint = self.version
        if self.rank == 0:
            delete_wals(self.exp.checkpoints, below=self._wal_seq)
        if self.metrics:
            self.metrics.log(event="checkpoint", step=self.version, checkpoint_s=time.perf_counter() - t0)

    def _open_wal(self, replay_existing: bool) -> TrajectoryLog:
        """The trajectory log to append to (see wal.py). On resume, first replay every log from
        the checkpoint's on (a crash during a checkpoint leaves two) and go on appending to the
        last; otherwise start afresh. Logs of older checkpoints are deleted."""
        root = self.exp.checkpoints
        if replay_existing:
            replayed = 0
            for seq in wal_seqs(root):
                if seq >= self._wal_seq:
                    replayed += sum(self.buffer.add(t) for t in wal_replay(wal_path(root, seq)))
                    self._wal_seq = seq
            if replayed:
                log.info("replayed %d trajectories received after the checkpoint", replayed)
        delete_wals(root, below=self._wal_seq if replay_existing else float("inf"))
        path = wal_path(root, self._wal_seq)
        return TrajectoryLog(path, truncate=not replay_existing)

    def _resume(self) -> None:
        path = checkpoint.latest(self.exp.checkpoints)
        if path is None:
            log.info("--resume: no checkpoint in %s; starting from version 0", self.exp.checkpoints)
            return
        sharded = self.backend.sharded_checkpoint
        rank_state, loop_state = checkpoint.load(path, self.rank, sharded=sharded)
        if sharded:
            self.backend.load_checkpoint(checkpoint.sharded_dir(path))
        elif "backend" not in rank_state:
            raise SystemExit(f"tandem trainer: {path} holds no per-rank backend state (written by "
                             f"trainer.backend: megatron?); resume it with the backend that wrote it")
        else:
            self.backend.load_state_dict(rank_state["backend"])
        self.version = int(loop_state.get("version", int(path.name.split("-")[1])))
        self._wal_seq = int(loop_state.get("wal_seq", 0))
        if self.rank == 0:
            self.buffer.load_state_dict(loop_state["buffer"])
            self.staleness = Counter(loop_state["staleness"])
            self.token_staleness = Counter(loop_state["token_staleness"])
            self.signals.rejected_seen = int(loop_state.get("rejected_seen", 0))
        self._last_checkpoint = self.version
        log.info("resumed from %s: version %d, %d groups ready, %d partial", path, self.version,
                 self.buffer.n_ready, self.buffer.n_partial)

    def close(self) -> None:
        self.backend.close()
        if self.rank == 0:
            # What it still holds (in the last checkpoint, or the log resume replays), after taking
            # in (and receipting) what is on the wire, and what it dropped since its last step.
            self.intake.close()
            self._drain(first_timeout_s=0)
            # Refused since the last step: recorded (the audit names them), their slots given back
            # by the next launch, whose buffer they stay in (state_dict).
            self._record_refused(self.buffer.refused)
            self.metrics.log(event="exit", version=self.version, held_ids=self.buffer.held_ids(),
                             dropped_ids=self._step_dropped + list(self.buffer.refused))
            self.intake.wal.close()
            self.controller.close()
            self.metrics.close()
        if dist.is_initialized():
            # Left to interpreter exit, gloo's threads can abort the process ("terminate called
            # without an active exception") after a run that otherwise finished well.
            dist.destroy_process_group()


def _by_reason(refused: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for gid, why in refused.items():
        out.setdefault(why, []).append(gid)
    return out


def _hist(counter: Counter) -> dict[str, int]:
    return {str(k): v for k, v in sorted(counter.items())}


def run_trainer(cfg, exp_dir: str | Path, resume: bool = False) -> int:
    exp = ExpDir(exp_dir)
    return Trainer(cfg, exp, resume=resume).run()
