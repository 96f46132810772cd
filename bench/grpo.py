"""``task=grpo`` against TRL 1.16's ``GRPOTrainer`` (``use_vllm=False``), one process, the same model, prompts,
G and lengths.

1. **Generation**, completion tokens per second: ours (``sampling.generate``, what the task runs: a group's
   prompt prefilled once, stopped rows leaving the batch, inverse-CDF sampling) against TRL's
   ``GRPOTrainer._generate`` (its prompts tokenized by the chat template, left-padded, Transformers'
   ``generate`` with TRL's generation config). ``--batch`` prompts × ``--generations`` completions of up to
   ``--completion`` tokens, temperature 1, no top-k/top-p, float32, one torch thread.
2. **The whole step**: ours (``GRPOTask.training_batches``: generate, decode, score, advantages; then
   ``GRPOTask.step``, backward and AdamW on each micro-batch) against TRL's (``GRPOTrainer.training_step``:
   generate, score, advantages, loss, backward; then AdamW), one optimizer step of ``--batch`` prompts, the same
   reward function, ``loss_type=dapo``, β = 0. The ratio is TRL's median step time / ours (> 1: ours faster).
3. **Memory of the log-probability pass**: one training step's forward and backward of the GRPO loss on
   ``--memory-rows`` completions of ``--memory-completion`` tokens at vocabulary ``--vocab`` (a Llama whose body is
   tiny, so the vocabulary-sized logits dominate), the chunked head (``task.loss_chunk``, ``--chunk``) against the
   whole block's logits (``task.loss_chunk=0``), each in a fresh process with glibc's malloc giving freed blocks
   back (``bench/sft.py``'s ``FREEING_MALLOC``): what the step adds to the process's peak resident memory.

The model: a Llama of ``--hidden`` × ``--layers`` (random weights: every completion runs to ``--completion``
tokens, so stopped rows leaving the batch does not show here) with the tiny chat tokenizer of the tests, grown to
``--vocab`` tokens with added ones (a real model's vocabulary size: the sampling cost scales with it).

    python bench/grpo.py [--vocab 32000] [--hidden 256] [--layers 4] [--batch 4] [--generations 8]
                         [--completion 64] [--rounds 3] [--memory-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def make_model(folder: Path, vocab: int, hidden: int, layers: int) -> Path:
    """The tiny chat Llama's folder, its tokenizer grown to ``vocab`` tokens, and its random weights saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.tiny_chat import make_tiny_chat_llama

    model = make_tiny_chat_llama(folder / "model", hidden=hidden, layers=layers, heads=8, kv_heads=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens([f"<w{i}>" for i in range(vocab - len(tokenizer))])
    tokenizer.save_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    return model


def prompt_rows(count: int) -> list[dict]:
    import random

    from tests.helpers.tiny_chat import exchange

    rng = random.Random(0)
    return [{"prompt": [{"role": "user", "content": exchange(rng)[0]}]} for _ in range(count)]


def reward(completions: list, **_: object) -> list[float]:
    """The same reward for both: the share of a completion's words that are "the"."""
    texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [sum(w == "the" for w in t.split()) / max(len(t.split()), 1) for t in texts]


class OneProcess:
    """The runtime as ``GRPOTask`` sees it, on one CPU process."""

    is_main_process, static_shapes, shards_the_model = True, False, False
    num_processes, process_index, project_dir = 1, 0, None

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()

    def register_for_checkpointing(self, *objects: object) -> None:
        pass

    def reduce(self, tensor, reduction="sum", scale=1.0):
        return tensor

    def gather_object(self, obj: list) -> list:
        return list(obj)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        return model.eval()


def ours_and_trl(folder: Path, model_dir: Path, a: argparse.Namespace):
    """Our task and TRL's trainer on the same model (two copies of the same weights), prompts and settings."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from app.tasks.grpo.config import GRPOConfig
    from app.tasks.grpo.task import GRPOTask
    from tests.helpers.tiny_chat import write_jsonl

    rows = prompt_rows(max(64, 4 * a.batch))
    write_jsonl(folder / "prompts.jsonl", rows)
    cfg = GRPOConfig(config=str(model_dir), cache_dir=str(folder / "cache"), block_size=a.completion + 64,
                     num_generations=a.generations, max_completion_length=a.completion,
                     rewards=[{"_target_": "grpo.reward"}])
    cfg.data_files.train = str(folder / "prompts.jsonl")
    task = GRPOTask(cfg)
    data = task.build_data(OneProcess())
    ours_model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    task.batch_plan(a.batch, 1, 1)
    task._loss_chunk = cfg.loss_chunk  # what build_model sets once chunking_holds(model, chunk)
    batches = [data.collate_fn([data.train[i] for i in range(s * a.batch, (s + 1) * a.batch)]) for s in range(4)]

    args = TRLConfig(output_dir=str(folder / "trl"), report_to=[], per_device_train_batch_size=a.batch * a.generations,
                     num_generations=a.generations, max_completion_length=a.completion, temperature=1.0, top_k=0,
                     top_p=1.0, loss_type="dapo", beta=0.0, use_cpu=True, bf16=False, logging_steps=10 ** 6)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first step
    trl_rows = [[row for row in rows[s * a.batch:(s + 1) * a.batch] for _ in range(a.generations)] for s in range(4)]
    optimizers = (torch.optim.AdamW(ours_model.parameters(), lr=1e-6), torch.optim.AdamW(trainer.model.parameters(),
                                                                                          lr=1e-6))
    return task, ours_model, batches, trainer, trl_rows, optimizers


def alternating(functions: dict, rounds: int, repeat: int) -> dict[str, list[float]]:
    """Each function's seconds per call (``repeat`` calls after one uncounted), rounds alternating the order."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for r in range(rounds):
        order = list(functions.items()) if r % 2 == 0 else list(reversed(functions.items()))
        for name, fn in order:
            fn(-1)
            started = time.perf_counter()
            for i in range(repeat):
                fn(i)
            times[name].append((time.perf_counter() - started) / repeat)
    return times


def speed(a: argparse.Namespace) -> None:
    import torch

    from app.tasks.grpo.generation import Prompts

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir = make_model(folder, a.vocab, a.hidden, a.layers)
        task, ours_model, batches, trainer, trl_rows, (ours_opt, trl_opt) = ours_and_trl(folder, model_dir, a)
        maker = task._maker
        assert maker is not None
        tokens = {"ours": 0, "trl": 0}

        def ours_generate(i: int) -> None:
            completions, _ = maker.complete(ours_model, Prompts.of(batches[i % 4]), i)
            tokens["ours"] += sum(len(c) for c in completions) if i >= 0 else 0

        def trl_generate(i: int) -> None:
            trainer.model.eval()
            prompts = [row["prompt"] for row in trl_rows[i % 4]]
            out = trainer._generate(prompts)
            trainer.model.train()
            tokens["trl"] += sum(len(c) for c in out[1]) if i >= 0 else 0

        generation = alternating({"ours": ours_generate, "trl": trl_generate}, a.rounds, 2)
        per_call = {name: tokens[name] / (a.rounds * 2) for name in tokens}
        rates = {name: [per_call[name] / s for s in seconds] for name, seconds in generation.items()}

        def ours_step(i: int) -> None:
            for micro in task.training_batches(ours_model, batches[i % 4], i + 1):
                out = task.step(ours_model, micro)
                (out.sample_losses.sum() / out.sample_items.sum()).backward()
            ours_opt.step()
            ours_opt.zero_grad()

        def trl_step(i: int) -> None:
            trainer.training_step(trainer.model, trl_rows[i % 4], None)
            trl_opt.step()
            trl_opt.zero_grad()

        steps = alternating({"ours": ours_step, "trl": trl_step}, a.rounds, 2)
    ours_rate, trl_rate = statistics.median(rates["ours"]), statistics.median(rates["trl"])
    print(f"setting: vocabulary {a.vocab:,}, Llama {a.hidden} x {a.layers}, {a.batch} prompts x {a.generations} "
          f"completions of up to {a.completion} tokens, float32, 1 thread; load {os.getloadavg()[0]:.1f}")
    print(f"generation: ours {ours_rate:,.0f} tokens/s, TRL {trl_rate:,.0f} tokens/s; ours / TRL = "
          f"{ours_rate / trl_rate:.2f} (rounds: {', '.join(f'{o / t:.2f}' for o, t in zip(rates['ours'], rates['trl']))})")
    ours_s, trl_s = statistics.median(steps["ours"]), statistics.median(steps["trl"])
    print(f"whole step: ours {ours_s:.3f} s, TRL {trl_s:.3f} s; TRL / ours = {trl_s / ours_s:.2f} (rounds: "
          f"{', '.join(f'{t / o:.2f}' for o, t in zip(steps['ours'], steps['trl']))})")


def memory(a: argparse.Namespace) -> None:
    from sft import FREEING_MALLOC

    peaks = {}
    for chunk in (0, a.chunk):
        out = subprocess.run([sys.executable, __file__, "--memory-worker", str(chunk), "--vocab", str(a.vocab),
                              "--memory-rows", str(a.memory_rows), "--memory-completion", str(a.memory_completion)],
                             check=True, capture_output=True, text=True, env={**os.environ, **FREEING_MALLOC}).stdout
        peaks[chunk] = json.loads(out.strip().splitlines()[-1])
        p = peaks[chunk]
        print(f"log-probability pass, {'whole logits' if chunk == 0 else f'chunked by {chunk}'}: the step adds "
              f"{p['step_mib']:,.0f} MiB above the {p['before_mib']:,.0f} MiB held before it (loss {p['loss']:.7f})")
    plain, chunked = peaks[0], peaks[a.chunk]
    print(f"memory at vocabulary {a.vocab:,}, {a.memory_rows} completions of {a.memory_completion} tokens: chunked / "
          f"whole = {chunked['step_mib'] / plain['step_mib']:.2f}; the losses differ by "
          f"{abs(chunked['loss'] - plain['loss']):.1e}")


def memory_worker(a: argparse.Namespace, chunk: int) -> None:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.tasks.causal_lm.config import LMDataFiles
    from app.tasks.grpo.config import GRPOConfig
    from app.tasks.grpo.rollouts import GENERATION_METRICS_KEY
    from app.tasks.grpo.task import GRPOTask

    torch.set_num_threads(1)
    torch.manual_seed(0)
    prompt, length, rows = 32, a.memory_completion, a.memory_rows
    model = LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                         max_position_embeddings=prompt + length))
    cfg = GRPOConfig(config="unused", data_files=LMDataFiles(train="unused.jsonl"), loss_chunk=chunk,
                     block_size=prompt + length + 1, max_completion_length=length, rewards=[{"_target_": "a.b"}])
    task = GRPOTask(cfg)
    task._loss_chunk = chunk
    task.batch_plan(rows, 1, 1)

    def batch(width: int) -> dict:
        ids = torch.randint(0, a.vocab, (rows, prompt + width))
        labels = ids.clone()
        labels[:, :prompt] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                "position_ids": torch.arange(prompt + width).expand(rows, -1), "completion_start": prompt,
                "completion_mask": torch.ones(rows, width), "advantages": torch.linspace(-1, 1, rows),
                GENERATION_METRICS_KEY: {}}

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)

    def train_step(b: dict) -> float:
        out = task.step(model, b)
        loss = out.sample_losses.sum() / out.sample_items.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(out.sample_metrics["entropy"].sum())  # the entropies: a value both variants compute

    train_step(batch(8))  # the optimizer's state, not counted
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    value = train_step(batch(length))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"before_mib": before / 1024, "step_mib": (peak - before) / 1024, "loss": value}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--memory-rows", type=int, default=8)
    parser.add_argument("--memory-completion", type=int, default=1024)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--memory-worker", type=int, default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.memory_worker is not None:
        memory_worker(a, a.memory_worker)
        return
    memory(a)  # first: a child's peak resident memory counts its parent's (Linux keeps it across exec)
    if not a.memory_only:
        speed(a)


if __name__ == "__main__":
    main()
