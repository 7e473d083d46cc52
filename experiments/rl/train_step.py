"""One training step on the master: from a batch of groups to trained weights and figures."""
from __future__ import annotations

import math

import numpy as np

from experiments.rl.algorithms.aggregation import loss_weights
from experiments.rl.algorithms.overlong import overlong_penalty
from experiments.rl.cluster import Cluster, sum_stats
from experiments.rl.config import RLConfig
from experiments.rl.shaping import advantages_grpo, advantages_ppo
from experiments.rl.state import Admitted, LoopState
from workers.schema import TrainItem, TrainStats, Trajectory


def train_step(cluster: Cluster, rl: RLConfig, batch: list[tuple[Admitted, int]],
               state: LoopState) -> dict[str, object]:
    """Proximal / reference log-probs, advantages (and the critic for PPO), the actor's steps
    (one per mini-batch of groups, ``rl.ppo_minibatches``); returns the step's figures."""
    staleness = [state.step - v for _, v in batch]
    state.max_staleness = max([state.max_staleness, *staleness])
    state.history.append([[int(a.group["prompt_id"]), a.epoch] for a, _ in batch])
    groups = [a.group["trajs"] for a, _ in batch]
    trajs = [t for g in groups for t in g]
    view = advantage_view(rl, groups)
    seen = [t for g in view for t in g]  # (what trains: overlong filtering's masks)
    items = train_items(cluster, rl, seen)
    stats: dict[str, object] = overlong_figures(rl, trajs, seen)
    if rl.algorithm == "grpo":
        advs = advantages_grpo(view, rl.group_size, rl.group_std_norm)
    else:
        seqs = [t["tokens"] for t in trajs]
        values = cluster.per_token(seqs, "critic")
        advs, returns = advantages_ppo(seen, values, rl)
        for it, v, r in zip(items, values, returns):
            it["old_values"] = v[it["prompt_len"] - 1:]
            it["returns"] = r
    for it, a in zip(items, advs):
        it["adv"] = a
    actor, critic, keys = [], [], session_keys(groups)
    for part in minibatches(groups, rl.ppo_minibatches):
        mine = [items[i] for i in part]
        if not any(it["mask"].any() for it in mine):
            continue  # overlong filtering took every token: no step (AdamW would still move)
        weights = loss_weights([it["mask"] for it in mine], rl.loss.aggregation,
                               rl.agent.max_new_tokens, [keys[i] for i in part])
        for it, w in zip(mine, weights or []):
            it["loss_weight"] = w
        if rl.algorithm == "ppo":
            critic.append(cluster.train(mine, critic=True))
        actor.append(cluster.train(mine))
    out = merge_steps(actor) if actor else TrainStats(loss=0.0, grad_norm=0.0)
    if critic:
        merged = merge_steps(critic)
        stats["value_loss"] = merged.get("value_loss_sum", 0.0) / max(merged.get("tokens", 1), 1)
    if not (math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])):
        raise NonFiniteTraining(
            f"step {state.step + 1}: the actor's loss {out['loss']} / grad_norm "
            f"{out['grad_norm']} is not finite: stopped before this step's weights are "
            "published or checkpointed (a recovery resumes from the last checkpoint)")
    return {**stats, **step_figures(rl, trajs, out, staleness)}


def advantage_view(rl: RLConfig, groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
    """The groups as the advantages and the loss see them: with DAPO's soft overlong
    punishment (``rl.overlong.buffer``) each trajectory's reward less the penalty of its
    length, with overlong filtering a cut one's mask all 0 (it trains no token, and PPO's
    whitening leaves its tokens out), in copies; else the groups themselves."""
    cfg = rl.overlong
    if not (cfg.buffer or cfg.filter):
        return groups
    out = []
    for g in groups:
        pen = overlong_penalty(np.asarray([len(t["mask"]) for t in g]),
                               rl.agent.max_new_tokens, cfg.buffer, cfg.penalty)
        view = []
        for t, p in zip(g, pen):
            cut = cfg.filter and t["finish"] == "length"
            view.append({**t, "reward": float(t["reward"]) + float(p),  # type: ignore[misc]
                         "mask": np.zeros_like(t["mask"]) if cut else t["mask"]})
        out.append(view)
    return out


def overlong_figures(rl: RLConfig, trajs: list[Trajectory], seen: list[Trajectory]
                     ) -> dict[str, object]:
    """``truncated_fraction``: the share of trajectories that stopped at the budget; with the
    soft punishment, ``overlong_penalty``: the mean reward it took (``seen``: their
    :func:`advantage_view`)."""
    cut = float(np.mean([t["finish"] == "length" for t in trajs])) if trajs else 0.0
    pen = (float(np.mean([s["reward"] - t["reward"] for s, t in zip(seen, trajs)]))
           if rl.overlong.buffer and trajs else None)
    return {"truncated_fraction": cut, "overlong_penalty": pen}


def minibatches(groups: list[list[Trajectory]], n: int) -> list[list[int]]:
    """The trajectory indices of each of ``n`` mini-batches: consecutive groups, whole (a
    group's advantages are relative to one another), as even as the count allows."""
    starts = np.cumsum([0] + [len(g) for g in groups])
    cuts = [len(groups) * k // n for k in range(n + 1)]
    return [list(range(int(starts[a]), int(starts[b]))) for a, b in zip(cuts, cuts[1:])]


def session_keys(groups: list[list[Trajectory]]) -> list[tuple[int, int]]:
    """Each trajectory's session (loss aggregation's sequence, as GRPO's advantages count
    them): ``(group, session)``; a trajectory without ``session`` is its own."""
    return [(g, int(t.get("session", j))) for g, trajs in enumerate(groups)
            for j, t in enumerate(trajs)]


def merge_steps(outs: list[TrainStats]) -> TrainStats:
    """The figures of a training step's optimizer steps: sums add up; the loss and gradient
    norm are their mean."""
    return sum_stats(outs, averaged=("loss", "grad_norm"))


class NonFiniteTraining(RuntimeError):
    """A training step met NaN or infinite numbers; going on would train (and publish, and
    checkpoint) NaN weights while the trial reports success."""


def check_behaviour_logprobs(trajs: list[Trajectory], step: int) -> None:
    """Refuse a batch whose generated tokens' log-probs are not finite (before any weight
    changes): the generation servers' weights are broken, and every later step would be NaN."""
    bad = [t for t in trajs
           if not np.isfinite(np.asarray(t["logprobs"], dtype=np.float64)[
               np.asarray(t["mask"]) > 0]).all()]
    if bad:
        versions = sorted({int(v) for t in bad for v in t["versions"] if v >= 0})
        raise NonFiniteTraining(
            f"step {step}: {len(bad)} of {len(trajs)} samples carry non-finite log-probs from "
            f"the generation servers (weights versions {versions}): their weights are broken "
            "(a publish in the wrong dtype, say); nothing was trained on them")


def train_items(cluster: Cluster, rl: RLConfig, trajs: list[Trajectory]) -> list[TrainItem]:
    """The batch as the model workers train on it, with proximal (decoupled async loss) and
    reference (KL) log-probs over the completion tokens (the loss aggregation's weights come
    per mini-batch, in :func:`train_step`)."""
    seqs = [t["tokens"] for t in trajs]
    items: list[TrainItem] = [{"tokens": t["tokens"], "prompt_len": int(t["prompt_len"]),
                               "mask": t["mask"].astype(np.float32), "old_logp": t["logprobs"]}
                              for t in trajs]
    temps = sampling_temperatures(trajs)
    for it, tt in zip(items, temps or []):
        if len(tt):
            it["temps"] = tt
    if rl.decoupled and rl.loss.proximal == "recompute":
        for it, lp in zip(items, cluster.per_token(seqs, "actor", temps)):
            it["prox_logp"] = lp[it["prompt_len"] - 1:]
    if rl.loss.kl_coef > 0:  # (the reference policy at the same temperatures, as verl)
        for it, lp in zip(items, cluster.per_token(seqs, "ref", temps)):
            it["ref_logp"] = lp[it["prompt_len"] - 1:]
    return items


def sampling_temperatures(trajs: list[Trajectory]) -> list[np.ndarray] | None:
    """Each trajectory's completion tokens' sampling temperatures (empty: all 1), or None when
    every token was sampled at 1: the trainer's log-probs are taken at the temperatures vLLM's
    behaviour log-probs describe."""
    temps = [np.asarray(t.get("temps", ()), np.float32) for t in trajs]
    if all(len(tt) == 0 or bool((tt == 1).all()) for tt in temps):
        return None
    return [tt if len(tt) and not bool((tt == 1).all()) else np.zeros(0, np.float32)
            for tt in temps]


def step_figures(rl: RLConfig, trajs: list[Trajectory], out: TrainStats,
                 staleness: list[int]) -> dict[str, object]:
    tokens = max(out.get("tokens", 1.0), 1.0)
    seconds = out.get("seconds", 0.0)
    gen_tokens = int(sum(int(t["mask"].sum()) for t in trajs))
    return {
        "reward": float(np.mean([t["reward"] for t in trajs])),
        "loss": out["loss"], "grad_norm": out["grad_norm"],
        "clip_fraction": out.get("clip_fraction_sum", 0.0) / tokens,
        "behav_weight_mean": out.get("behav_weight_mean_sum", 0.0) / tokens,
        "kl": out.get("kl_sum", 0.0) / tokens if rl.loss.kl_coef > 0 else None,
        "logp_mismatch": out.get("logp_mismatch_sum", 0.0) / tokens,
        "dual_clip_fraction": (out.get("dual_clip_fraction_sum", 0.0) / tokens
                               if rl.loss.dual_clip > 0 else None),
        "train_seconds": seconds,
        "train_tokens_per_s": out.get("train_tokens", 0.0) / max(seconds or 1e-9, 1e-9),
        "gen_tokens": gen_tokens,
        "completion_len": gen_tokens / max(len(trajs), 1),
        "staleness_max": max(staleness), "staleness_mean": float(np.mean(staleness)),
        "versions": sorted({int(v) for t in trajs for v in t["versions"] if v >= 0}),
        "cut_samples": sum(len({int(v) for v in t["versions"] if v >= 0}) > 1 for t in trajs),
    }
