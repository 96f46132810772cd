"""``task=sft`` data preparation against TRL's ``SFTTrainer``: conversations tokenized and labelled per
second, in one invocation, after one uncounted call of each (first-call costs), alternating (ours, TRL's,
TRL's, ours, ...), the figure being the median of each round's ours / TRL's ratio.

Held equal: the conversations (``--conversations`` of 1 to ``--turns`` user/assistant exchanges, half
with a system message: tests/helpers/tiny_chat.py's toy grammar), the tokenizer (its byte-level BPE), one
process, no cache, learnt tokens = every assistant turn with its end-of-turn token. Ours: the plain
ChatML template, spans found by rendering prefix by prefix (the template compiled once,
``app/tasks/sft/render.py``), the whole conversation tokenized once (``app/tasks/sft/tokens.py``'s
``tokenize_split``: datasets.map, labels, rows with nothing learnt dropped). TRL's: ChatML with
``{% generation %}`` markers and ``assistant_only_loss=True`` (what it needs for the same mask), timed
as ``SFTTrainer``'s construction on a 1-layer model (its dataset preparation is nearly all of it).

Training (``--train-steps`` > 0, after the data preparation rounds): learnt tokens per second over
the steps after the first ``--log-every`` (warm-up), ours (``app.engine.run``, in-process, the engine's
own ``train/tokens_per_s`` windows: tokens whose label is not -100) against ``SFTTrainer.train()``
(the same count, taken from each batch its collator makes, timed at the same steps by a callback),
alternating, median of the rounds' ratios. Held equal: the model (a Llama of ``--hidden``/``--layers``,
float32, the same saved random weights), the conversations (the first ``--train-conversations``), one
conversation per row padded per batch (``packing`` off in both), batch ``--batch``, AdamW at lr 2e-5,
linear schedule with 5 % warm-up, clipping at 1.0, one torch thread, no checkpoints. Not equal, each
side's defaults: TRL computes entropy and token accuracy at every step (host reads); ours reads the
loss at log steps only.

Peak memory of the loss (first, ``--memory-only`` for it alone): one forward and backward of a Llama
whose body is tiny (``--memory-hidden`` wide, one layer) so that the vocabulary-sized logits dominate,
at vocabulary ``--vocab`` (32k) and block ``--block`` (2048), batch 1, float32, each in its own process
(``--memory-worker``): the plain loss (``task.loss_chunk=0``: the whole block's logits at once) against
the chunked one (``task.loss_chunk``, ``--chunk``), through ``SFTTask.step`` both, then AdamW's step and
the gradients freed. The figure: what the training step adds, its peak resident memory (``ru_maxrss``)
less the process's peak before it (the imports, the model, the batch, the optimizer's state made by one
uncounted step on 8 positions), with glibc's malloc set to give freed blocks back (``FREEING_MALLOC``), so
that it measures memory in use; also shown: the whole process's peak, and both under the default malloc.

    python bench/sft.py [--conversations 2000] [--turns 6] [--rounds 3] [--train-steps 60] [--batch 8]
    python bench/sft.py --memory-only [--vocab 32000] [--block 2048] [--chunk 256]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FREEING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc's malloc in the memory workers: blocks of 64 KiB and more mapped on their own and unmapped when
freed, so the peak resident memory is of the memory in use, not of what the allocator kept (without it,
the same step's figure varies by a third from run to run)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=60, help="0: no training comparison")
    parser.add_argument("--train-conversations", type=int, default=600)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--memory-hidden", type=int, default=64)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--memory-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.memory_worker is not None:
        memory_worker(args, args.memory_worker)
        return
    memory(args)
    if args.memory_only:
        return
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    from app.tasks.sft.config import DataFormat, SFTConfig, TrainOn
    from app.tasks.sft.conversations import Fields
    from app.tasks.sft.records import Places
    from app.tasks.sft.spans import SpanFinder
    from app.tasks.sft.tokens import tokenize_split
    from app.tasks.text.sources import Split
    from tests.helpers.tiny_chat import conversations, make_tokenizer
    from tests.test_sft_trl import CHATML_WITH_MARKERS

    datasets.disable_progress_bars()
    datasets.disable_caching()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rows = [{"messages": c} for c in conversations(args.conversations, seed=0, max_turns=args.turns)]
    data = datasets.Dataset.from_list(rows)
    cfg = SFTConfig(config="unused", block_size=4096)

    def ours() -> float:
        tokenizer = make_tokenizer()
        start = time.perf_counter()
        traits = SpanFinder(tokenizer, TrainOn.assistant).probe()  # the task's one probe of the template
        out = tokenize_split(Split(data, f"bench-{time.time_ns()}", "bench"), Places("bench", "row"), "train",
                             tokenizer, cfg, DataFormat.messages, Fields.of(cfg), traits, None)
        assert len(out.rows) == len(rows)
        return len(rows) / (time.perf_counter() - start)

    def theirs() -> float:
        tokenizer = make_tokenizer(CHATML_WITH_MARKERS)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        with tempfile.TemporaryDirectory() as folder:
            options = TRLConfig(output_dir=folder, report_to=[], max_length=4096, use_cpu=True,
                                assistant_only_loss=True)
            start = time.perf_counter()
            trainer = SFTTrainer(model=model, args=options, train_dataset=data, processing_class=tokenizer)
            elapsed = time.perf_counter() - start
        assert len(trainer.train_dataset) == len(rows)
        return len(rows) / elapsed

    ours(), theirs()  # warm-up, not counted: first-call costs (imports, compiled templates) on neither side
    ratios = []
    for r in range(args.rounds):
        a, b = (ours(), theirs()) if r % 2 == 0 else (theirs(), ours())[::-1]
        ratios.append(a / b)
        print(f"round {r + 1}: ours {a:,.0f} conversations/s, TRL's {b:,.0f}: ratio {a / b:.2f}")
    print(f"data preparation, {args.conversations} conversations of up to {args.turns} exchanges: "
          f"ours / TRL's = {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")
    if args.train_steps > 0:
        training(args, rows[:args.train_conversations])


def memory(args: argparse.Namespace) -> None:
    """The step's peak memory, plain loss against chunked, each in a fresh process (see the docstring)."""
    import json
    import subprocess

    ratios = {}
    for allocator, env in (("freeing malloc", FREEING_MALLOC), ("default malloc", {})):
        peaks = {}
        for chunk in (0, args.chunk):
            out = subprocess.run([sys.executable, __file__, "--memory-worker", str(chunk), "--vocab", str(args.vocab),
                                  "--block", str(args.block), "--memory-hidden", str(args.memory_hidden)],
                                 check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
            p = peaks[chunk] = json.loads(out.strip().splitlines()[-1])
            print(f"loss memory ({allocator}), {'plain' if chunk == 0 else f'chunked by {chunk}'}: the training "
                  f"step's peak {p['step_mib']:,.0f} MiB above the {p['before_mib']:,.0f} MiB held before it (process "
                  f"peak {p['peak_mib']:,.0f} MiB; loss {p['loss']:.7f})")
        plain, chunked = peaks[0], peaks[args.chunk]
        ratios[allocator] = (chunked["step_mib"] / plain["step_mib"], chunked["peak_mib"] / plain["peak_mib"],
                             abs(chunked["loss"] - plain["loss"]))
    (step, process, diff), (step_default, process_default, _) = ratios.values()
    print(f"loss memory at vocabulary {args.vocab}, block {args.block}: chunked / plain = {step:.2f} (what the "
          f"training step adds; whole process: {process:.2f}); with glibc's default malloc, which keeps freed "
          f"blocks: {step_default:.2f} (whole process {process_default:.2f}); the losses differ by {diff:.1e}")


def memory_worker(args: argparse.Namespace, chunk: int) -> None:
    import json
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.tasks.causal_lm.config import LMDataFiles
    from app.tasks.sft.config import SFTConfig
    from app.tasks.sft.task import SFTTask

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = args.memory_hidden
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=args.block, tie_word_embeddings=False))
    task = SFTTask(SFTConfig(config="unused", data_files=LMDataFiles(train="unused.jsonl"), loss_chunk=chunk))
    ids = torch.randint(0, args.vocab, (1, args.block))
    labels = ids.clone()
    labels[:, : args.block // 4] = -100  # a prompt not learnt
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    task._loss_chunk = chunk  # what build_model sets once chunking_holds(model, chunk)

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # its state made and updated, the weights kept: the
    # two variants' losses then compare

    def kib() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def train_step(b: dict) -> float:
        out = task.step(model, b)
        loss = out.sample_losses.sum() / out.sample_items.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # as the engine's loop does: the gradients freed
        return float(loss)

    train_step({k: v[:, :8] for k, v in batch.items()})  # the optimizer's state made on 8 positions, not counted
    before = kib()
    loss = train_step(batch)
    peak = kib()
    print(json.dumps({"before_mib": before / 1024, "peak_mib": peak / 1024, "step_mib": (peak - before) / 1024,
                      "loss": loss}))


def training(args: argparse.Namespace, rows: list[dict]) -> None:
    """Learnt tokens/s of ours against ``SFTTrainer.train()`` (see the module's docstring)."""
    import json

    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    from app.engine.run import run
    from tests.conftest import compose_config
    from tests.helpers.tiny_chat import make_tiny_chat_llama, make_tokenizer, write_jsonl
    from tests.test_sft_trl import CHATML_WITH_MARKERS

    lr, block, steps, every = 2e-5, 1024, args.train_steps, args.log_every
    warm = max(1, steps // 20)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_chat_llama(root / "model", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(model_dir)
        train = write_jsonl(root / "train.jsonl", rows)
        validation = write_jsonl(root / "val.jsonl", rows[:8])
        data = datasets.Dataset.from_list(rows)

        def ours() -> float:
            out = root / f"ours-{time.time_ns()}"
            out.mkdir()
            run(compose_config(
                "task=sft", f"task.model={model_dir}", f"task.data_files.train={train}",
                f"task.data_files.validation={validation}", "task.packing=false", f"task.block_size={block}",
                f"task.cache_dir={root / 'cache'}", f"trainer.batch_size={args.batch}", f"trainer.max_steps={steps}",
                f"trainer.log_every_n_steps={every}", f"optim.lr={lr}", "scheduler=linear", f"scheduler.warmup_steps={warm}",
                "trainer.max_grad_norm=1.0", "hardware.num_threads=1", "logging.trackers=[]",
                "logging.progress_bar=false", "logging.print_config=false", "checkpoint.every_epoch=false",
                "checkpoint.save_final_model=false", "early_stopping.patience=null"), out)
            rows_ = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            windows = [r["train/tokens_per_s"] for r in rows_ if r.get("train/tokens_per_s")]
            return statistics.mean(windows[1:])

        def theirs() -> float:
            torch.set_num_threads(1)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            options = TRLConfig(output_dir=str(root / "trl"), report_to=[], max_length=block, use_cpu=True,
                                assistant_only_loss=True, packing=False, per_device_train_batch_size=args.batch,
                                max_steps=steps, logging_steps=every, save_strategy="no", learning_rate=lr,
                                lr_scheduler_type="linear", warmup_steps=warm, max_grad_norm=1.0,
                                dataloader_num_workers=0, disable_tqdm=True, seed=42)
            trainer = SFTTrainer(model=model, args=options, train_dataset=data,
                                 processing_class=make_tokenizer(CHATML_WITH_MARKERS))
            collate = trainer.data_collator
            counted = {"tokens": 0}

            def counting(features: list) -> dict:
                batch = collate(features)
                counted["tokens"] += int((batch["labels"] != -100).sum())
                return batch

            marks: list[tuple[float, int]] = []

            class Windows(TrainerCallback):  # type: ignore[misc]
                def on_step_end(self, _args, state, control, **kwargs):
                    if state.global_step % every == 0:
                        marks.append((time.perf_counter(), counted["tokens"]))

            trainer.data_collator = counting
            trainer.add_callback(Windows())
            trainer.train()
            rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(marks)]
            return statistics.mean(rates)

        ratios = []
        for r in range(args.rounds):
            a, b = (ours(), theirs()) if r % 2 == 0 else (theirs(), ours())[::-1]
            ratios.append(a / b)
            print(f"training round {r + 1}: ours {a:,.0f} learnt tokens/s, TRL's {b:,.0f}: ratio {a / b:.2f}", flush=True)
        print(f"training, {len(rows)} conversations, batch {args.batch}, {steps} steps, Llama {args.hidden} wide x "
              f"{args.layers} layers: ours / TRL's = {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
