"""``task=sft`` data preparation against TRL's ``SFTTrainer``: conversations tokenized and labelled per
second, in one invocation, alternating (ours, TRL's, TRL's, ours, ...), the figure being the median of
each round's ours / TRL's ratio.

Held equal: the conversations (``--conversations`` of 1 to ``--turns`` user/assistant exchanges, half
with a system message: tests/tiny_chat.py's toy grammar), the tokenizer (its byte-level BPE), one
process, no cache, learnt tokens = every assistant turn with its end-of-turn token. Ours: the plain
ChatML template, spans found by rendering prefix by prefix (``app/tasks/sft/tokens.py``'s
``tokenize_split``: datasets.map, labels, rows with nothing learnt dropped). TRL's: ChatML with
``{% generation %}`` markers and ``assistant_only_loss=True`` (what it needs for the same mask), timed
as ``SFTTrainer``'s construction on a 1-layer model (its dataset preparation is nearly all of it).

    python bench/sft.py [--conversations 2000] [--turns 6] [--rounds 3]

Not measured yet (issue 38): training tokens/s against SFTTrainer, and peak memory of a chunked loss.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    from app.tasks.sft.config import DataFormat, SFTConfig
    from app.tasks.sft.tokens import tokenize_split
    from app.tasks.text.sources import Split
    from tests.test_sft_trl import CHATML_WITH_MARKERS
    from tests.tiny_chat import conversations, make_tokenizer

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
        out, _, _ = tokenize_split(Split(data, f"bench-{time.time_ns()}", "bench"), "train", tokenizer, cfg,
                                   DataFormat.messages, None)
        assert len(out) == len(rows)
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

    ratios = []
    for r in range(args.rounds):
        a, b = (ours(), theirs()) if r % 2 == 0 else (theirs(), ours())[::-1]
        ratios.append(a / b)
        print(f"round {r + 1}: ours {a:,.0f} conversations/s, TRL's {b:,.0f}: ratio {a / b:.2f}")
    print(f"data preparation, {args.conversations} conversations of up to {args.turns} exchanges: "
          f"ours / TRL's = {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
