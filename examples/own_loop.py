"""cpjax's selection and calibration report in a plain flax + optax loop (no cpjax trainer).

  python -m examples.own_loop --epochs 6

scikit-learn's handwritten digits (real, bundled), an MLP, SGD. After one warm-up epoch
each epoch trains on the 30 % of the examples with the highest predictive entropy
(Tata et al. 2022's top-k), scored by the train step itself; the end prints the test
accuracy, ECE and NLL before and after temperature scaling fitted on validation.
docs/library.md walks through it.
"""

import argparse

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

from cpjax.calibration import metrics, posthoc
from cpjax.selection import api, scores


def load(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Digits as float [N, 64] in [0, 1]: 1,257 train, 180 validation, 360 test (seeded)."""
  digits = load_digits()
  x, y = digits.data.astype(np.float32) / 16.0, digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  parts = {"test": order[:360], "val": order[360:540], "train": order[540:]}
  return {name: (x[rows], y[rows]) for name, rows in parts.items()}


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


model, tx = MLP(), optax.sgd(0.1, momentum=0.9)


@jax.jit
def train_step(params, opt_state, x, y):
  """One SGD step; also each example's entropy score (before the update, as the trainer's)."""
  def loss_fn(p):
    logits = model.apply(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits
  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, scores.normalized_entropy(logits)


def train(epochs: int = 6, fraction: float = 0.3, seed: int = 0, batch_size: int = 64):
  """Trains with top-k entropy selection; returns what it selected and the report."""
  data = load(seed)
  x_train, y_train = data["train"]
  ids = np.arange(len(x_train))  # An example's id: its row in the training arrays.
  selection = api.Selection(ids, y_train, method="top_k", fraction=fraction,
                            warmup_epochs=1, num_epochs=epochs, seed=seed)
  state = selection.init()  # Checkpoint it with params and opt_state to resume exactly.
  params = model.init(jax.random.PRNGKey(seed), x_train[:1])
  opt_state = tx.init(params)
  history = []
  for epoch in range(epochs):
    subset = selection.select(state, epoch)
    history.append({"epoch": epoch, "scores": state["scores"].copy(), "ids": subset.ids})
    order = np.random.default_rng([seed, epoch]).permutation(subset.ids)
    for start in range(0, len(order), batch_size):
      batch = order[start:start + batch_size]
      params, opt_state, loss, entropy = train_step(params, opt_state, x_train[batch],
                                                    y_train[batch])
      state = selection.record(state, batch, entropy)
    print(f"epoch {epoch}: {len(subset.ids)} examples, last batch loss {float(loss):.3f}")
  return history, report(params, data)


def report(params, data) -> dict[str, float]:
  """Test accuracy, ECE and NLL, raw and after temperature scaling fitted on validation."""
  val_logits, test_logits = (np.asarray(model.apply(params, data[s][0])) for s in ("val", "test"))
  labels = data["test"][1]
  calibrator = posthoc.fit("temperature", val_logits, data["val"][1])
  calibrated = posthoc.apply(calibrator, test_logits)  # Log-probabilities.
  return {"accuracy": metrics.accuracy(metrics.softmax(test_logits), labels),
          "ece": metrics.ece(metrics.softmax(test_logits), labels),
          "nll": metrics.nll(test_logits, labels),
          "temperature": float(np.exp(calibrator.params["log_t"])),
          "ece_calibrated": metrics.ece(np.exp(calibrated), labels),
          "nll_calibrated": metrics.nll(calibrated, labels)}  # log_softmax keeps log-probs.


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--fraction", type=float, default=0.3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  _, results = train(args.epochs, args.fraction, args.seed)
  for name, value in results.items():
    print(f"{name}: {value:.4f}")


if __name__ == "__main__":
  main()
