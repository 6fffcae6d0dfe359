"""Does selection (and calibration) still pay when the model is trained properly?

Every run is configs/fashion_mnist_long.py (small_cnn, crop+flip, 54,000
training images, 20 epochs of cosine SGD, epoch 0 on all data, test on the
10,000 test images) with one arm:

  clean labels      full; same_budget-P (all data, cut to a P % run's optimizer
                    steps); random-P; rs2-P (RS2, without replacement);
                    topk_entropy-P (train-pass entropy); topk_fresh-10 (an
                    eval-mode scoring pass every epoch, its cost counted);
                    sampled-P (Gumbel-top-k, T = 0.1); infobatch (r = 0.5,
                    delta = 0.875)
  calibration       flsd53_full, flgamma_full (FL_gamma-SECE); topk_flsd53-P and
                    topk_flgamma-P (top-k entropy with the current model trained by
                    that loss); topk_mixup_target-P (a mixup target's recorded
                    entropies, as Tata et al. 2022) and topk_gamma_target-P (the
                    flgamma_full seed-0 run's model scoring once)
  noisy labels      20 % of the training labels flipped uniformly to another class
                    (generated noise on the real images; validation and test labels
                    clean): noisy_full, noisy_random-30, noisy_topk_entropy-30,
                    noisy_sampled-30, noisy_infobatch, and noisy_rho-30 (RHO-LOSS:
                    reducible loss with a target trained on a held-out 10 % of the
                    training split, the selecting run trained on the other 90 %; the
                    current model's losses from a fresh pass over every example each
                    epoch, as the paper's losses are the current model's, its cost
                    counted; noisy_rho_train_pass-30 ranks by the train pass's losses,
                    stale for every example not trained on since)
  schedule check    full_e10, full_e30 (seed 0): validation accuracy of 10- and
                    30-epoch schedules beside the 20-epoch one

for P in 10 and 30, seeds 0, 1, 2. Targets are trained once (seed 0) and
their cost is reported apart and added to the arms that need them. The arms
run in tiers (A: the answers, B: the calibrated scorers first, then more
policies, C: the 10 % variants of B), each tier seed by seed, so a study cut short has
every seed of the most important arms. After every run the summary
(summary.md, summary.json) and the figures are rewritten from what finished.
Each finished run leaves a small record (numbers, curves, per-test-image
correctness and confidence) in studies/results/long_schedule_runs/, committed
with the results: a run with a record or a report is not retrained and an
interrupted run resumes from its checkpoint, so rerunning the command continues
the study, on this machine or on a fresh clone:

  python -m studies.long_schedule --out=studies/out/long_schedule

Costs are counted in example passes (a forward pass of one example counts 1,
forward + backward 3; evaluation passes, the same in every arm, are left out)
and in measured seconds of the loop's scoring + selection + training phases.
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import time
import traceback

import jax
import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from configs import fashion_mnist_long  # noqa: E402
from cpjax.calibration import metrics  # noqa: E402
from cpjax.data import splits  # noqa: E402
from cpjax.runtime import preemption, provenance  # noqa: E402
from cpjax.selection import policies  # noqa: E402
from studies import equivalence, grid  # noqa: E402

SEEDS = (0, 1, 2)
NOISE = {"dataset.label_noise": 0.2, "dataset.label_noise_seed": 0}
META_VAL_SIZE = 5000  # FL_gamma's meta-validation carve-out (as the meta-calibration study).
HOLDOUT = 0.1  # RHO-LOSS: share of the training split held out for the target.
SAMPLED = {"selection.method": "sampled", "selection.temperature": 0.1}
INFOBATCH = {"selection.method": "infobatch", "selection.score": "loss",
             "selection.prune_ratio": 0.5, "selection.anneal_fraction": 0.125}
FLGAMMA = {"loss.name": "flgamma_sece", "dataset.meta_val_size": META_VAL_SIZE}
# RHO-LOSS: top-k reducible loss, the target trained on a held-out share of the training split
# and the selecting run on the rest.
RHO = {**NOISE, "selection.method": "top_k", "selection.fraction": 0.3,
       "selection.score": "reducible_loss", "dataset.holdout_fraction": HOLDOUT,
       "dataset.train_part": "rest"}
# Targets: trained once with seed 0, whatever the arm's seed.
TARGETS = {
    "target_mixup": {"loss.mixup_alpha": 0.15, "selection.record_scores": True},
    "target_rho": {**NOISE, "dataset.holdout_fraction": HOLDOUT,
                   "dataset.train_part": "holdout"},
}
CONFIDENCE = 0.9  # Every interval of the summary.
BOOTSTRAP = 1000  # Paired bootstrap resamples of the test images.
# One file per finished run, committed beside the summary: the summary and a rerun of the
# study read them instead of the workdirs (gigabytes of checkpoints, not committed), so a
# study that moves to another machine keeps every finished run.
RECORDS = "studies/results/long_schedule_runs"


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  overrides: dict
  tier: str  # A, B or C: the order in which arms run.
  regime: str = "clean"  # clean or noisy: the panel and the references it is paired with.
  budget: int = 0  # Per cent kept per selected epoch; 0 = no fixed budget.
  target: str = ""  # A TARGETS name, or an arm whose seed-0 run is the target.
  seeds: tuple = SEEDS


def _top_k(fraction: float, **extra) -> dict:
  return {"selection.method": "top_k", "selection.fraction": fraction, **extra}


def arms(base) -> list[Arm]:
  """Every arm of the study, in the order the tiers run them."""
  out = [Arm("full", {}, "A"),
         Arm("full_e10", {"num_epochs": 10}, "A", seeds=(0,)),
         Arm("flsd53_full", {"loss.name": "flsd53"}, "A"),
         Arm("noisy_full", NOISE, "A", "noisy"),
         Arm("infobatch", INFOBATCH, "A"),
         Arm("noisy_infobatch", {**NOISE, **INFOBATCH}, "B", "noisy"),
         Arm("flgamma_full", FLGAMMA, "B"),
         Arm("full_e30", {"num_epochs": 30}, "B", seeds=(0,))]
  for pct in (30, 10):
    f = pct / 100
    later = "B" if pct == 30 else "C"
    out += [
        Arm(f"random-{pct}", {"selection.method": "random", "selection.fraction": f}, "A",
            budget=pct),
        Arm(f"topk_entropy-{pct}", _top_k(f), "A", budget=pct),
        Arm(f"topk_flsd53-{pct}", _top_k(f, **{"loss.name": "flsd53"}),
            "A" if pct == 30 else "C", budget=pct),
        Arm(f"same_budget-{pct}", {"budget_steps": budget_steps(base, f),
                                   "optimizer.schedule_unit": "step"}, later, budget=pct),
        Arm(f"rs2-{pct}", {"selection.method": "random_without_replacement",
                           "selection.fraction": f}, later, budget=pct),
        Arm(f"sampled-{pct}", {**SAMPLED, "selection.fraction": f}, later, budget=pct),
        Arm(f"topk_flgamma-{pct}", _top_k(f, **FLGAMMA), later, budget=pct),
        Arm(f"topk_mixup_target-{pct}", _top_k(f, **{"selection.scoring": "target_recorded"}),
            later, budget=pct, target="target_mixup"),
        Arm(f"topk_gamma_target-{pct}", _top_k(f, **{"selection.scoring": "target",
                                                     "selection.rescore_every": 0}),
            later, budget=pct, target="flgamma_full")]
  out += [Arm("topk_fresh-10", _top_k(0.1, **{"selection.scoring": "fresh"}), "B", budget=10),
          Arm("noisy_random-30", {**NOISE, "selection.method": "random",
                                  "selection.fraction": 0.3}, "A", "noisy", 30),
          Arm("noisy_topk_entropy-30", {**NOISE, **_top_k(0.3)}, "A", "noisy", 30),
          Arm("noisy_rho-30", {**RHO, "selection.scoring": "fresh"}, "A", "noisy", 30,
              target="target_rho"),
          Arm("noisy_rho_train_pass-30", RHO, "A", "noisy", 30, target="target_rho"),
          Arm("noisy_sampled-30", {**NOISE, **SAMPLED, "selection.fraction": 0.3}, "B",
              "noisy", 30)]
  # Within a tier Tata et al.'s question (a calibrated scorer) runs first, then the order
  # above (a stable sort).
  return sorted(out, key=lambda arm: (arm.tier, not asks_seed_question(arm)))


def asks_seed_question(arm: Arm) -> bool:
  """Whether the arm's scores come from a model trained with FL_gamma-SECE, or from a
  calibrated target (mixup, gamma-Net), or is the full-data run that target needs."""
  return (arm.overrides.get("loss.name") == "flgamma_sece"
          or arm.target in ("target_mixup", "flgamma_full"))


def base_config():
  """The study's base run config: configs/fashion_mnist_long.py with the report's ECE
  intervals at 200 resamples (not used here) and no OOD split."""
  base = fashion_mnist_long.get_config()
  base.evaluation.bootstrap_resamples = 200
  base.evaluation.ood = ""
  return base


def run_config(arm_name: str, seed: int):
  """The full config of one run of arm `arm_name`."""
  base = base_config()
  return grid.apply(base, {**{a.name: a for a in arms(base)}[arm_name].overrides, "seed": seed})


def budget_steps(config, fraction: float) -> int:
  """Optimizer steps of a run keeping `fraction` per selected epoch: the warm-up epochs
  in full, then ceil(k / batch) steps per epoch."""
  num_rows = splits.num_train_examples(config.dataset)
  k = policies.subset_size(fraction, 0, num_rows)
  full, subset = -(-num_rows // config.batch_size), -(-k // config.batch_size)
  warmup = config.selection.warmup_epochs
  return warmup * full + (config.num_epochs - warmup) * subset


# ---------------------------------------------------------------------------------------------
# One run's numbers.


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def epoch_steps(config, records: list[dict]) -> list[int]:
  """Optimizer steps of each epoch: its selected examples in batches, within the step budget."""
  steps_left, out = config.budget_steps or math.inf, []
  for record in records:
    out.append(int(min(-(-record["selected_k"] // config.batch_size), steps_left)))
    steps_left -= out[-1]
  return out


def steady_seconds(config, records: list[dict]) -> float:
  """The run's training time at the lower quartile of its epochs' seconds per step, plus its
  scoring and selection seconds: about what the run costs on a machine nothing else slows.
  Measured seconds move with the load of a shared machine, and the faster epochs are the
  least slowed. Not the fastest: an epoch resumed after an interruption times only its
  remaining steps, so it looks faster than it ran."""
  steps = epoch_steps(config, records)
  per_step = float(np.quantile([r["training_seconds"] / n for r, n in zip(records, steps) if n],
                               0.25))
  return float(per_step * sum(steps) + sum(r["scoring_seconds"] + r["selection_seconds"]
                                           for r in records))


def example_passes(config, records: list[dict]) -> np.ndarray:
  """Cumulative example passes after each epoch: 3 per example trained (forward + backward),
  1 per example of a scoring pass, 1 per meta-validation example of a gamma-Net step."""
  batch = config.batch_size
  per_step = 3 * batch + (batch if config.loss.name.startswith("flgamma") else 0)
  num_train = splits.num_train_examples(config.dataset)
  passes, selection = [], config.selection
  for record, steps in zip(records, epoch_steps(config, records)):
    scoring = 0
    selected = selection.method != "full" and record["epoch"] >= selection.warmup_epochs
    if selected and selection.scoring == "fresh":
      scoring = num_train  # rescore_every = 1: every selected epoch.
    first_selected = selected and record["epoch"] == selection.warmup_epochs
    if first_selected and (selection.scoring == "target" or selection.score == "reducible_loss"):
      scoring = num_train  # Scored once by the target's model (rescore_every = 0).
    passes.append(per_step * steps + scoring)
  return np.cumsum(passes, dtype=np.float64)


def save_record(path: str, row: dict) -> None:
  """Writes one finished run's row (numbers, curves, per-test-image correctness and
  confidence) to a small compressed file, atomically: a crash leaves the old file or none."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  numbers = {k: v for k, v in row.items() if k not in ("correct", "confidence")}
  temporary = f"{path}.tmp.npz"
  np.savez_compressed(temporary, row=json.dumps(numbers),
                      correct=np.packbits(np.asarray(row["correct"], np.uint8)),
                      num_test=len(row["correct"]),
                      confidence=np.asarray(row["confidence"], np.float32))
  os.replace(temporary, path)


def load_record(path: str) -> dict:
  """The row that save_record wrote."""
  with np.load(path) as f:
    row = json.loads(str(f["row"]))
    correct = np.unpackbits(f["correct"])[:int(f["num_test"])]
    row.update(correct=correct.astype(np.int8).tolist(), confidence=f["confidence"].tolist())
  return row


def run_row(base, arm_overrides: dict, workdir: str, record: str | None = None) -> dict:
  """One run's numbers and curves: read from its `record` file when that exists (the
  committed records outlive the workdirs), else trained unless its report exists, then
  written to `record`."""
  if record and os.path.exists(record):
    return load_record(record)
  row = _run_row(base, arm_overrides, workdir)
  if record:
    save_record(record, row)
  return row


def machine() -> str:
  """The machine a run trained on, for the summary: CPU model, cores, JAX and its backend,
  and on an accelerator its devices (count and kind, e.g. '1 x NVIDIA H100 80GB HBM3')."""
  backend = jax.default_backend()
  text = f"{provenance.cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} on {backend}"
  if backend != "cpu":
    kinds = [d.device_kind for d in jax.devices()]
    text += ", " + ", ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))
  return text


def machine_of(origin: dict) -> str:
  """`machine()`'s text for the sitting a run's provenance describes (its process's machine,
  not this one's: a record rebuilt from a run folder names where the run trained)."""
  text = (f"{origin['cpu']}, {origin['cpu_count']} cores, jax {origin['jax']} on "
          f"{origin['platform']}")
  if origin["platform"] != "cpu":
    text += f", {origin['device_count']} x {origin['device_kind']}"
  return text


def _run_row(base, arm_overrides: dict, workdir: str) -> dict:
  config = grid.apply(base, arm_overrides)
  row = grid.run_cell(base, arm_overrides, workdir)
  records = _records(workdir)
  passes = example_passes(config, records)
  compute = np.cumsum([sum(r[f"{p}_seconds"] for p in ("scoring", "selection", "training"))
                       for r in records])
  evaluated = [i for i, r in enumerate(records) if "test_accuracy" in r]
  with np.load(os.path.join(workdir, "report", "test_logits.npz")) as f:
    logits, labels = f["logits"], f["labels"]
  selected = [r for r in records if "subset_class_kl" in r]
  row.update(
      val_accuracy=records[-1]["val_accuracy"],
      passes=float(passes[-1]), compute_seconds=float(compute[-1]),
      steady_seconds=steady_seconds(config, records),
      curve_epoch=[records[i]["epoch"] + 1 for i in evaluated],
      curve_passes=[float(passes[i]) for i in evaluated],
      curve_seconds=[float(compute[i]) for i in evaluated],
      curve_accuracy=[records[i]["test_accuracy"] for i in evaluated],
      class_kl=float(np.mean([r["subset_class_kl"] for r in selected])) if selected else 0.0,
      # The report's sitting's machine, whose wall clock the row holds (`grid.run_cell`).
      machine=machine_of(row["provenance"][-1]) if row["provenance"] else machine(),
      # Where the run's wall clock went (cpjax.runtime.anatomy: start-up, data open,
      # compiling, warm-up and steady steps, evaluation, scoring, checkpoints, the report).
      anatomy={k: v for k, v in records[-1].items() if k.startswith("perf/")},
      correct=(np.argmax(logits, -1) == labels).astype(np.int8).tolist(),
      confidence=np.max(metrics.softmax(logits), -1).astype(np.float32).tolist())
  return row


# ---------------------------------------------------------------------------------------------
# Paired statistics.


def whole_runs(r: dict) -> list[int]:
  """The runs (indices) whose wall clock covers the whole run: at least their scoring +
  selection + training seconds, which are summed over sittings, while a resumed run's wall
  clock is its last sitting's alone (a resume whose last sitting was the longer part is not
  told apart)."""
  return [i for i, (w, c) in enumerate(zip(r["wall_seconds"], r["compute_seconds"])) if w >= c]


def seed_interval(differences) -> tuple[float, float, float]:
  """(mean, low, high): a t interval at CONFIDENCE over the per-seed differences."""
  d = np.asarray(differences, np.float64)
  if len(d) < 2:
    return float(d.mean()), math.nan, math.nan
  half = stats.t.ppf(0.5 + CONFIDENCE / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
  return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def _ece(confidence: np.ndarray, correct: np.ndarray, num_bins: int = 15) -> np.ndarray:
  """ECE of each row of [R, n] arrays (equal-width bins, right-closed as the report's)."""
  bins = np.clip(np.ceil(confidence * num_bins).astype(np.int64) - 1, 0, num_bins - 1)
  rows = np.arange(len(confidence))[:, None] * num_bins + bins
  size = confidence.shape[1]
  gap = (np.bincount(rows.ravel(), (confidence - correct).ravel(), len(confidence) * num_bins))
  return np.abs(gap.reshape(len(confidence), num_bins)).sum(1) / size


def test_interval(arm: dict, reference: dict, seeds: list[int], key: str,
                  rng_seed: int = 0) -> tuple[float, float]:
  """A paired bootstrap over the test images of the seed-mean difference (arm - reference)
  in accuracy ("accuracy") or ECE ("ece"): the same resampled images for both runs of a
  seed and for every seed. The test set's own sampling interval at CONFIDENCE."""
  n = len(arm["correct"][0])
  index = np.random.default_rng(rng_seed).integers(0, n, (BOOTSTRAP, n))
  total = np.zeros(BOOTSTRAP)
  for a, r in ((arm["seed_index"][s], reference["seed_index"][s]) for s in seeds):
    for sign, run, i in ((1, arm, a), (-1, reference, r)):
      correct = np.asarray(run["correct"][i], np.float64)[index]
      if key == "accuracy":
        total += sign * correct.mean(1)
      else:
        total += sign * _ece(np.asarray(run["confidence"][i], np.float64)[index], correct)
  low, high = np.quantile(total / len(seeds), [0.5 - CONFIDENCE / 2, 0.5 + CONFIDENCE / 2])
  return float(low), float(high)


def paired(arm: dict, reference: dict) -> dict | None:
  """Per-seed differences arm - reference over the seeds both finished."""
  seeds = sorted(set(arm["seed_index"]) & set(reference["seed_index"]))
  if not seeds:
    return None
  out = {"seeds": seeds}
  for key in ("accuracy", "ece", "ece_after_ts"):
    d = [arm[key][arm["seed_index"][s]] - reference[key][reference["seed_index"][s]]
         for s in seeds]
    out[key] = seed_interval(d)
    if key == "accuracy":
      out["tost"] = equivalence.tost(d)
  for key in ("accuracy", "ece"):
    out[f"{key}_test"] = test_interval(arm, reference, seeds, key)
  return out


def references(arm: Arm) -> dict[str, str]:
  """{label: arm name} of the runs an arm is paired with."""
  prefix = "noisy_" if arm.regime == "noisy" else ""
  refs = {"full": f"{prefix}full"}
  if arm.budget:
    refs["random"] = f"{prefix}random-{arm.budget}"
  if arm.name.startswith(("topk_flsd53", "topk_flgamma", "topk_mixup", "topk_gamma",
                          "topk_fresh")):
    refs["ce_topk"] = f"topk_entropy-{arm.budget}"  # The seed question: vs a CE scorer.
  if arm.name in ("flsd53_full", "flgamma_full"):
    refs = {"full": "full"}
  return {label: name for label, name in refs.items() if name != arm.name}


# ---------------------------------------------------------------------------------------------
# The summary.


def _pct(value: float, digits: int = 2) -> str:
  return "—" if value is None or not np.isfinite(value) else f"{100 * value:+.{digits}f}"


def _interval(triple) -> str:
  mean, low, high = triple
  if not np.isfinite(low):
    return f"{_pct(mean)} (1 seed)"
  return f"{_pct(mean)} [{_pct(low)}, {_pct(high)}]"


def _saving(passes: float, full: float | None) -> str:
  return "—" if not full else f"{100 * (1 - passes / full):.0f} %"


def summarise(all_arms: list[Arm], results: dict, targets: dict) -> dict:
  """Means, savings and paired differences of every arm with a finished run."""
  by_name = {a.name: a for a in all_arms}
  summary = {}
  for name, r in results.items():
    arm = by_name[name]
    # Savings against full data of the arm's own regime (else the other one's: same cost).
    full = [f for f in (references(arm).get("full", name), "full", "noisy_full")
            if f in results]
    full_passes = np.mean(results[full[0]]["passes"]) if full else None
    full_seconds = np.mean(results[full[0]]["compute_seconds"]) if full else None
    target_passes = targets.get(arm.target, {}).get("passes", 0.0)
    target_seconds = targets.get(arm.target, {}).get("compute_seconds", 0.0)
    target_steady = targets.get(arm.target, {}).get("steady_seconds", 0.0)
    # The median over seeds: one run slowed throughout by other work does not move it.
    full_steady = np.median(results[full[0]]["steady_seconds"]) if full else None
    row = {key: (float(np.mean(r[key])), float(np.std(r[key], ddof=1)) if len(r[key]) > 1
                 else 0.0) for key in ("accuracy", "ece", "ece_after_ts", "val_accuracy")}
    row.update(seeds=sorted(r["seed_index"]), passes=float(np.mean(r["passes"])),
               compute_seconds=float(np.mean(r["compute_seconds"])),
               steady_seconds=float(np.median(r["steady_seconds"])),
               target_passes=target_passes, target_seconds=target_seconds,
               class_kl=float(np.mean(r["class_kl"])),
               wall_runs=len(whole_runs(r)),
               wall_seconds=float(np.mean([r["wall_seconds"][i] for i in whole_runs(r)]))
               if whole_runs(r) else math.nan)
    if full_passes:
      row["saving_passes"] = 1 - row["passes"] / full_passes
      row["saving_passes_with_target"] = 1 - (row["passes"] + target_passes) / full_passes
      row["saving_seconds"] = 1 - row["compute_seconds"] / full_seconds
      row["saving_seconds_with_target"] = 1 - (row["compute_seconds"] + target_seconds) / (
          full_seconds)
      row["saving_steady"] = 1 - row["steady_seconds"] / full_steady
      row["saving_steady_with_target"] = 1 - (row["steady_seconds"] + target_steady) / (
          full_steady)
    row["paired"] = {label: paired(r, results[ref]) for label, ref in references(arm).items()
                     if ref in results}
    if (effect := scorer_effect(arm, results)) is not None:
      row["scorer_effect"] = effect
    summary[name] = row
  return summary


# The loss each calibrated-scorer arm trains with, and that loss's own full-data arm.
OWN_FULL = {"topk_flsd53": "flsd53_full", "topk_flgamma": "flgamma_full"}


def scorer_effect(arm: Arm, results: dict) -> dict | None:
  """The scorer's own effect on accuracy, net of its loss's accuracy cost: per seed,
  (top-k with the loss - the loss's full-data run) - (CE top-k - CE full data)."""
  prefix = arm.name.split("-")[0]
  if prefix not in OWN_FULL:
    return None
  names = (arm.name, OWN_FULL[prefix], f"topk_entropy-{arm.budget}", "full")
  if any(n not in results for n in names):
    return None
  runs = [results[n] for n in names]
  seeds = sorted(set.intersection(*(set(r["seed_index"]) for r in runs)))
  if not seeds:
    return None
  value = lambda r, s: r["accuracy"][r["seed_index"][s]]  # noqa: E731
  d = [(value(runs[0], s) - value(runs[1], s)) - (value(runs[2], s) - value(runs[3], s))
       for s in seeds]
  out = {"seeds": len(seeds), "accuracy": seed_interval(d), "tost": equivalence.tost(d)}
  out["verdict"] = verdict(out)
  return out


LOSSLESS = equivalence.MARGIN  # The equivalence margin of "lossless": 0.2 points.


def verdict(p: dict | None, key: str = "accuracy") -> str:
  """'better', 'worse' or 'no difference' by the seed t interval of a paired difference;
  'undecided' with fewer than 2 seeds (no interval) or no pair."""
  if p is None or not np.isfinite(p[key][1]):
    return "undecided"
  _, low, high = p[key]
  return "better" if low > 0 else "worse" if high < 0 else "no difference"


def lossless(p: dict | None) -> bool:
  """Equivalent to the reference at the LOSSLESS margin by the TOST, with a mean difference
  of at least -0.1 points (studies/equivalence.py)."""
  return p is not None and equivalence.lossless(p["tost"])


def _said(name: str, p: dict | None, label: str) -> str:
  if p is None:
    return f"{name}: no pair with {label} yet"
  mean, low, high = p["accuracy"]
  seeds = len(p["seeds"])
  spread = f"[{_pct(low)}, {_pct(high)}]" if np.isfinite(low) else "(1 seed, no interval)"
  said = verdict(p)
  if said == "no difference":  # An interval holding 0 is no evidence of equivalence.
    said = f"no difference detected, {equivalence.describe(p['tost'])}"
  return (f"{name} {_pct(mean)} points vs {label} {spread}, test images "
          f"[{_pct(p['accuracy_test'][0])}, {_pct(p['accuracy_test'][1])}], {seeds} seed"
          f"{'s' if seeds > 1 else ''}: {said}")


def answers(all_arms: list[Arm], summary: dict) -> list[str]:
  """The study's questions answered from the paired seed intervals, in plain words."""
  by_name = {a.name: a for a in all_arms if a.name in summary}
  def pairs(label, keep):
    return [(n, summary[n]["paired"].get(label)) for n, a in by_name.items()
            if keep(a) and label in references(a)]
  lines = ["## Answers", "",
           "Each verdict reads the 90 % t interval of the per-seed paired differences in test "
           "accuracy: better or worse when it lies wholly above or below 0, else no "
           "difference detected, printed with its equivalence test (two one-sided t-tests "
           "at a ±0.2-point margin: an interval that holds 0 is not evidence of no "
           "difference); undecided with one seed.", ""]
  lines.append("**(a) Does any policy beat per-epoch random on the long schedule?**")
  for budget in (30, 10):
    found = pairs("random", lambda a, b=budget: a.regime == "clean" and a.budget == b)
    lines += [f"- {budget} % kept: " + ("; ".join(_said(n, p, "random") for n, p in found)
                                       or "no finished arm")]
  lines += ["", "**(b) Does a calibration-trained model or a calibrated target select better "
            "than a cross-entropy model (top-k entropy, same budget)?**"]
  found = pairs("ce_topk", lambda a: True)
  lines += [f"- {_said(n, p, 'CE top-k')}" for n, p in found] or ["- no finished arm"]
  lines += ["", "A model trained with another loss pays that loss's own accuracy cost on full "
            "data too. The scorer's own effect is the difference of differences, (top-k with "
            "the loss - the loss on full data) - (CE top-k - CE full data), per seed:"]
  lines += [f"- {name}: {_interval(e['accuracy'])}, {e['seeds']} seeds"
            + (f", {equivalence.describe(e['tost'])}" if e["verdict"] == "no difference"
               else f": {e['verdict']}")
            for name, e in ((n, summary[n].get("scorer_effect")) for n in by_name) if e] or [
      "- no finished arm"]
  lines += ["", "**(c) Which policy loses nothing under 20 % label noise (vs full data on the "
            "same noisy labels)?** Every noisy arm here shares one noise draw "
            "(`dataset.label_noise_seed=0`), so the seeds vary the training, not the noise."]
  found = pairs("full", lambda a: a.regime == "noisy")
  lines += [f"- {_said(n, p, 'noisy full')}" for n, p in found] or ["- no finished arm"]
  lines += ["", "**Targets**"] + _targets(by_name, summary) + [""]
  return lines


def _targets(by_name: dict, summary: dict) -> list[str]:
  def saving(name):
    return summary[name].get("saving_steady_with_target", math.nan)
  clean30 = [n for n, a in by_name.items() if a.regime == "clean" and a.budget == 30]
  met = [n for n in clean30 if lossless(summary[n]["paired"].get("full")) and saving(n) >= 0.5]
  lines = [f"- 30 % kept lossless (equivalent to full data at ±{100 * LOSSLESS:.1f} points "
           "by the TOST, mean >= -0.1) at >= 50 % of the steady seconds saved: "
           + (f"met by {', '.join(met)}" if met else "missed")
           + "; " + "; ".join(f"{n} {_pct(summary[n]['paired']['full']['accuracy'][0])} "
                                f"({100 * saving(n):.0f} % saved)"
                                for n in clean30 if summary[n]["paired"].get("full"))]
  if "infobatch" in summary and summary["infobatch"]["paired"].get("full"):
    p = summary["infobatch"]["paired"]["full"]
    ok = lossless(p) and saving("infobatch") >= 0.35
    lines.append(f"- InfoBatch lossless at >= 35 % saved: {'met' if ok else 'missed'}; "
                 f"{_said('infobatch', p, 'full')}, {100 * saving('infobatch'):.0f} % of the "
                 "steady seconds saved")
  # Every selecting policy under noise, InfoBatch (no fixed budget) too.
  noisy = [(n, summary[n]["paired"].get("full")) for n, a in by_name.items()
           if a.regime == "noisy" and n != "noisy_full" and summary[n]["paired"].get("full")]
  if noisy:
    name, p = max(noisy, key=lambda item: item[1]["accuracy"][0])
    ok = verdict(p) == "better" or lossless(p)
    lines.append(f"- Under 20 % noise the best policy is lossless or better than full data: "
                 f"{'met' if ok else 'missed'}; best {_said(name, p, 'noisy full')}")
  return lines


def status(all_arms: list[Arm], summary: dict, results: dict) -> list[str]:
  """How much of the study has finished, per tier, and the machines its runs trained on."""
  done = lambda arms: sum(len(summary[a.name]["seeds"]) for a in arms if a.name in summary)  # noqa: E731
  planned = lambda arms: sum(len(a.seeds) for a in arms)  # noqa: E731
  tiers = sorted({a.tier for a in all_arms})
  per_tier = "; ".join(f"tier {t}: {done(arms)} of {planned(arms)}" for t in tiers
                       for arms in [[a for a in all_arms if a.tier == t]])
  machines = sorted({m for r in results.values() for m in r.get("machine", [])})
  return [f"**Status:** {done(all_arms)} of {planned(all_arms)} planned runs finished "
          f"({per_tier}); rerunning the command continues the study. Trained on: "
          + ("; ".join(machines) or "not recorded") + ". " + grid.code_versions_line(results),
          ""]


def markdown(all_arms: list[Arm], summary: dict, targets: dict, failures: dict,
             command: str, results: dict) -> str:
  order = [a.name for a in all_arms if a.name in summary]
  lines = ["# Selection on a long schedule: Fashion-MNIST, clean and noisy labels", "",
           f"`{command}`; configs/fashion_mnist_long.py: small_cnn, crop+flip, 54,000 train / "
           "6,000 val / 10,000 test images, 20 epochs (epoch 0 on all data), batch 128, cosine "
           "SGD. Test accuracy and ECE (15 bins) in %, mean ± std over seeds. Paired "
           "differences (arm - reference, in points): the mean over seeds with a 90 % t "
           "interval across seeds, then [in brackets after 'test:'] the 90 % paired bootstrap "
           f"interval over the test images ({BOOTSTRAP} resamples) of the same mean. Saving = "
           "1 - cost / full's cost, in example passes (forward 1, forward + backward 3; "
           "evaluation left out), in measured seconds of the scoring + selection + training "
           "phases (mean over seeds), and in steady seconds (the median over seeds of training "
           "at the lower quartile of a run's epochs' seconds per step, plus scoring and "
           "selection: measured seconds move with whatever else shares the machine); 'with "
           "target' adds the target run's whole cost to the arm. Wall s: the mean wall clock "
           "of the run's `train.train_and_evaluate` (training, scoring, evaluation, "
           "compiling, the report; `studies.grid.run_cell`) over "
           "the runs whose wall clock covers the whole run (at least their phase seconds: a "
           "resumed run's covers its last sitting alone), with their number.", ""]
  lines += status(all_arms, summary, results) + answers(all_arms, summary)
  lines += ["## Arms", "",
            "| arm | seeds | test acc % | test ECE % | ECE after TS % | val acc % | saving "
            "passes / with target | saving seconds / with target | saving steady seconds / "
            "with target | class KL | wall s (whole runs) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name in order:
    s = summary[name]
    ms = lambda key: f"{100 * s[key][0]:.2f} ± {100 * s[key][1]:.2f}"  # noqa: E731
    lines.append(
        f"| {name} | {len(s['seeds'])} | {ms('accuracy')} | {ms('ece')} | "
        f"{ms('ece_after_ts')} | {ms('val_accuracy')} | "
        f"{_saving_cell(s, 'passes')} | {_saving_cell(s, 'seconds')} | "
        f"{_saving_cell(s, 'steady')} | {s['class_kl']:.3f} | {_wall_cell(s)} |")
  lines += ["", "## Paired differences", "",
            "| arm | vs | seeds | Δ acc (points) | test: Δ acc | Δ ECE | test: Δ ECE | Δ ECE "
            "after TS |", "|---|---|---|---|---|---|---|---|"]
  for name in order:
    for label, p in summary[name]["paired"].items():
      if p is None:
        continue
      lines.append(
          f"| {name} | {label} | {len(p['seeds'])} | {_interval(p['accuracy'])} | "
          f"[{_pct(p['accuracy_test'][0])}, {_pct(p['accuracy_test'][1])}] | "
          f"{_interval(p['ece'])} | [{_pct(p['ece_test'][0])}, {_pct(p['ece_test'][1])}] | "
          f"{_interval(p['ece_after_ts'])} |")
  if targets:
    lines += ["", "Targets (seed 0, trained once): " + "; ".join(
        f"{name}: {t['passes'] / 1e6:.2f} M passes, {t['compute_seconds']:.0f} s "
        f"({t['steady_seconds']:.0f} steady), test acc "
        f"{100 * t['accuracy']:.2f} %" for name, t in targets.items())]
  if failures:
    lines += ["", "## Failed runs", ""] + [f"- {k}: {v}" for k, v in failures.items()]
  return "\n".join(lines) + "\n"


def _wall_cell(s: dict) -> str:
  wall = "—" if not s["wall_runs"] else f"{s['wall_seconds']:.0f}"
  return f"{wall} ({s['wall_runs']} of {len(s['seeds'])})"


def _saving_cell(s: dict, unit: str) -> str:
  if f"saving_{unit}" not in s:
    return "—"
  return (f"{100 * s[f'saving_{unit}']:.0f} % / "
          f"{100 * s[f'saving_{unit}_with_target']:.0f} %")


# ---------------------------------------------------------------------------------------------
# Figures.


OFF_SCALE = 6.0  # Points: the paired-differences figure's half-width, and how far below the
# best arm a curve may end and still set its panel's range.
PANELS = (("clean", 10), ("clean", 30), ("clean", 0), ("noisy", 30), ("noisy", 0))
STYLES = [(c, ls) for ls in ("-", "--") for c in plt.get_cmap("tab10").colors]


def plot_curves(all_arms: list[Arm], results: dict, path: str) -> None:
  """Test accuracy vs cumulative example passes, one panel per (regime, budget); the line is
  the mean over seeds and the band the seeds' range. Full data is drawn in every panel."""
  columns = 3
  rows = -(-len(PANELS) // columns)
  fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 5.5 * rows), squeeze=False)
  axes = axes.ravel()
  for ax in axes[len(PANELS):]:
    ax.set_axis_off()
  for ax, (regime, budget) in zip(axes, PANELS):
    late = []  # Mean accuracies of the second half of each run: the panel's y range.
    names = [a.name for a in all_arms if a.regime == regime and a.budget == budget
             and a.name in results and not a.name.startswith("full_e")]
    reference = "noisy_full" if regime == "noisy" else "full"
    if budget and reference in results:
      names = [reference, *names]
    curves = {}
    for name in names:
      r = results[name]
      curves[name] = (np.mean([c for c in r["curve_passes"]], axis=0) / 1e6,
                      100 * np.asarray(r["curve_accuracy"], np.float64))
    best = max((accuracy.mean(0)[-1] for _, accuracy in curves.values()), default=0.0)
    for (colour, style), (name, (passes, accuracy)) in zip(STYLES, curves.items()):
      # An arm that ends far below the best leaves the panel, so the others stay readable.
      off_scale = accuracy.mean(0)[-1] < best - OFF_SCALE
      ax.plot(passes, accuracy.mean(0), style, color=colour, marker=".",
              label=f"{name} ({len(accuracy)} seeds)"
              + (f", ends at {accuracy.mean(0)[-1]:.1f} %: below the panel" if off_scale else ""))
      ax.fill_between(passes, accuracy.min(0), accuracy.max(0), color=colour, alpha=0.15)
      if not off_scale:
        late += list(accuracy.mean(0)[len(passes) // 2:])
    if late:
      ax.set_ylim(min(late) - 1.5, max(late) + 0.5)
    ax.set_title(f"{regime} labels, " + (f"{budget} % kept per selected epoch" if budget
                                         else "no fixed budget"))
    # Log passes: a 10 % arm ends near a tenth of full data's cost, and on a linear axis its
    # whole curve would sit in the first tenth of the panel.
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_plain))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda value, _: _plain(value) if _leading_digit(value) in (2, 3, 5) else ""))
    ax.set_xlabel("cumulative example passes (millions, log scale)")
    ax.grid(alpha=0.3)
    if names:
      ax.legend(fontsize=7)
    else:
      ax.text(0.5, 0.5, "no finished runs yet", ha="center", transform=ax.transAxes)
  for ax in axes[::columns]:
    ax.set_ylabel("test accuracy % (line: mean; band: range over seeds)")
  fig.suptitle("Fashion-MNIST, small_cnn, 20 epochs with crop+flip: accuracy vs training cost")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plain(value: float, _=None) -> str:
  return f"{value:g}"


def _leading_digit(value: float) -> int:
  return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0


def plot_differences(all_arms: list[Arm], summary: dict, path: str) -> None:
  """Paired accuracy differences vs per-epoch random and vs full data: thick bar = 90 % seed
  interval, thin bar = the test images' 90 % bootstrap interval, dot = mean. The axis spans
  +-OFF_SCALE points so that one collapsed arm does not flatten the others: bars are cut at
  its edge and a mean beyond it is written there."""
  labels = ("random", "full")
  fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(summary) + 2), sharey=True)
  names = [a.name for a in all_arms if a.name in summary][::-1]
  for ax, label in zip(axes, labels):
    for y, name in enumerate(names):
      p = summary[name]["paired"].get(label)
      if p is None:
        continue
      mean, low, high, test_low, test_high = np.clip(
          [100 * v for v in (*p["accuracy"], *p["accuracy_test"])], -OFF_SCALE, OFF_SCALE)
      ax.plot([test_low, test_high], [y, y], color="grey", linewidth=1)
      if np.isfinite(low):
        ax.plot([low, high], [y, y], color="C0", linewidth=4, alpha=0.6)
      ax.plot(mean, y, "o", color="C3")
      if abs(100 * p["accuracy"][0]) > OFF_SCALE:
        ax.annotate(f"{100 * p['accuracy'][0]:+.1f} (off scale)", (mean, y),
                    xytext=(6 if mean < 0 else -6, 4), textcoords="offset points",
                    ha="left" if mean < 0 else "right", fontsize=8, color="C3")
    ax.set_xlim(-OFF_SCALE - 0.3, OFF_SCALE + 0.3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_title(f"test accuracy: arm - {label} (points)")
    ax.grid(alpha=0.3, axis="x")
  axes[0].set_yticks(range(len(names)), names, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The loop.


def _add(results: dict, name: str, seed: int, row: dict) -> None:
  entry = results.setdefault(name, {"seed_index": {}})
  if seed in entry["seed_index"]:
    return
  entry["seed_index"][seed] = len(entry["seed_index"])
  for key, value in row.items():
    entry.setdefault(key, []).append(value)


def write_outputs(out: str, all_arms, results, targets, failures, command) -> None:
  summary = summarise(all_arms, results, targets)
  slim = {name: {k: v for k, v in r.items() if k not in ("correct", "confidence")}
          for name, r in results.items()}
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"summary": summary, "runs": slim, "targets": targets, "failures": failures},
              f, indent=1, default=lambda o: o if not isinstance(o, np.generic) else o.item())
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(markdown(all_arms, summary, targets, failures, command, results))
  plot_curves(all_arms, results, os.path.join(out, "time_to_accuracy.png"))
  plot_differences(all_arms, summary, os.path.join(out, "paired_differences.png"))


def record_path(records: str, arm_name: str, seed: int) -> str:
  return os.path.join(records, arm_name, f"seed{seed}.npz")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="studies/out/long_schedule",
                      help="workdirs (checkpoints, reports), summary and figures")
  parser.add_argument("--records", default=RECORDS,
                      help=f"one small file per finished run, read instead of its workdir "
                           f"(default {RECORDS}, committed with the results)")
  parser.add_argument("--tiers", default="ABC", help="tiers to run, in order (default ABC)")
  parser.add_argument("--only", nargs="*", default=None, help="run only these arms")
  parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                      help="run only these seeds (default 0 1 2)")
  parser.add_argument("--summarise-only", action="store_true",
                      help="rewrite the summary from finished runs, train nothing")
  args = parser.parse_args()
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
  base = base_config()
  command = f"python -m studies.long_schedule --out={args.out}"
  os.makedirs(args.out, exist_ok=True)
  all_arms = [dataclasses.replace(a, seeds=tuple(s for s in a.seeds if s in args.seeds))
              for a in arms(base) if args.only is None or a.name in args.only]
  todo = [(a, seed) for tier in args.tiers for a in all_arms if a.tier == tier
          for seed in a.seeds]
  todo.sort(key=lambda item: (item[0].tier, item[1]))  # Tier by tier, seed by seed.
  results, targets, failures = {}, {}, {}
  for done, (arm, seed) in enumerate(todo):
    workdir = os.path.join(args.out, arm.name, f"seed{seed}")
    record = record_path(args.records, arm.name, seed)
    finished = (os.path.exists(record)
                or os.path.exists(os.path.join(workdir, "report", "results.json")))
    if args.summarise_only and not finished:
      continue
    try:
      overrides = {**arm.overrides, "seed": seed}
      if arm.target:
        overrides["selection.target_workdir"] = _target(
            args.out, args.records, base, arm.target, targets,
            train=not (finished or args.summarise_only))
      print(f"[{time.strftime('%H:%M:%S')}] run {done + 1}/{len(todo)}: tier {arm.tier} "
            f"{arm.name} seed {seed}" + (" (finished)" if finished else ""), flush=True)
      _add(results, arm.name, seed, run_row(base, overrides, workdir, record))
    except preemption.Preempted:
      raise  # A stop request stops the study; its checkpoint resumes the run on the rerun.
    except Exception as err:  # One failed run must not stop the study: it is reported.
      failures[f"{arm.name} seed {seed}"] = f"{type(err).__name__}: {str(err)[:300]}"
      print(f"[{time.strftime('%H:%M:%S')}] FAILED {arm.name} seed {seed}: "
            f"{traceback.format_exc()}", flush=True)
    if not args.summarise_only:  # After every run, so a study cut short reports what finished.
      write_outputs(args.out, all_arms, results, targets, failures, command)
  if args.summarise_only:  # Once, at the end: rewriting after each of ~80 finished runs
    # took most of a quarter-hour of bootstraps (seconds per pair).
    write_outputs(args.out, all_arms, results, targets, failures, command)
  print(f"[{time.strftime('%H:%M:%S')}] done: {args.out}/summary.md", flush=True)


def _target(out: str, records: str, base, name: str, targets: dict, train: bool) -> str:
  """The workdir of target `name` and its cost in `targets`. With `train`, an arm is about
  to read the target's model or scores, so its workdir is trained (seed 0) first if it is
  missing, even where a record of it exists; otherwise the record is enough."""
  if name in TARGETS:
    workdir, record = os.path.join(out, name), os.path.join(records, f"{name}.npz")
    overrides = {**TARGETS[name], "seed": 0}
  else:  # An arm's seed-0 run.
    workdir, record = os.path.join(out, name, "seed0"), record_path(records, name, 0)
    overrides = {**{a.name: a for a in arms(base)}[name].overrides, "seed": 0}
  trained = os.path.exists(os.path.join(workdir, "report", "results.json"))
  if name in targets and (trained or not train):
    return workdir
  if not (trained or train or os.path.exists(record)):
    raise FileNotFoundError(f"target {name} has not run")
  print(f"[{time.strftime('%H:%M:%S')}] target {name}", flush=True)
  row = _run_row(base, overrides, workdir) if train and not trained else None
  if row is not None:
    save_record(record, row)
  else:
    row = run_row(base, overrides, workdir, record)
  targets[name] = {k: row[k] for k in ("passes", "compute_seconds", "steady_seconds",
                                       "accuracy")}
  return workdir


if __name__ == "__main__":
  main()
