"""What the preference tasks share (``task=dpo``, ``task=kto``): ``task=sft``'s model, tokenizer, chat
template and export; the data pipeline (files read, checked, tokenized into items of two token rows each
and cached, bad rows judged by ``task.bad_rows``, held out, numbered; or a stream), whose row-level parts
each task gives (:meth:`PreferenceTask._encoder` and the other hooks); the reference model
``task.reference`` chooses (``reference.py``), and TR-DPO's synchronisation of it
(``task.sync_ref_every``: after every that many optimizer steps the reference moves towards the policy;
the moved reference is saved with every checkpoint, so a resumed run goes on exactly); the forward pass
whose logits give each sequence's log-probabilities (``logps.py``).

An item is two token rows (task=dpo: a pair's chosen and rejected sides; task=kto: an answer and its
mismatched KL sequence), collated as the batch's first rows, then its second rows (:class:`PairCollator`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import TaskData, TaskRuntime
from app.tasks.causal_lm.documents import hold_out
from app.tasks.causal_lm.models import flops_per_token, load_model, model_source
from app.tasks.dpo.config import PreferenceConfig, Reference
from app.tasks.dpo.packing import PackedPairCollator, PackedPairs, per_item_values
from app.tasks.dpo.pairs import COUNTS, SIDES
from app.tasks.dpo.reference import AdaptersDisabled, FrozenCopy, Precomputed
from app.tasks.dpo.stream import PairStream
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.bad_rows import Skipped, skipped_of
from app.tasks.sft.packing import SFTCollator
from app.tasks.sft.records import Places, sample_records
from app.tasks.sft.task import SFTTask
from app.tasks.text.sources import Split, check_data_files
from app.tasks.text.task import digest, run_main_first
from app.tasks.text.tokenization import cache_root, tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

CACHE_VERSION = 5
"""Part of the cache key: bump it when an encoder changes what it produces."""


class PairCollator:
    """Items into one batch: every item's first row (``sides[0]``: ``chosen_ids``/``chosen_labels``...),
    then every item's second row (``SFTCollator``: padded on the right, -100 labels, an attention mask
    where lengths differ), each item's number ``pair`` and its ``per_item`` values (task=kto's ``label``,
    task=reward_model's ``margin``: ``packing.per_item_values``)."""

    def __init__(self, pad_id: int, fixed_length: int | None = None, sides: tuple[str, str] = SIDES,
                 per_item: tuple[str, ...] = ()):
        self.rows, self.sides, self.per_item = SFTCollator(pad_id, fixed_length), sides, ("pair", *per_item)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.rows([{"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]}
                           for side in self.sides for p in items])
        return {**batch, **per_item_values(items, self.per_item)}


class PreferenceTask(SFTTask):
    """``SFTTask`` with a reference model beside the policy (none for a reference-free objective), on
    items of two token rows. A task gives its rows' parts: :meth:`_fields` (the columns it reads, picklable),
    :meth:`_encoder` (a ``datasets.map`` function: records -> items, with ``error``, ``place``, ``raw``
    and the fitting counts), :meth:`_features`, :meth:`_check_columns`, :meth:`_conversational`,
    :meth:`_stream` and :meth:`_bad_streamed`; and may complete a split's items (:meth:`_completed`)."""

    unit = "pairs"
    """What the log calls the items."""
    sides: tuple[str, str] = SIDES
    """The items' two rows, by column prefix, in the collated batch's order."""
    per_item: tuple[str, ...] = ()
    """Further columns of an item that its batches carry, packed or not (task=kto's ``label``, task=reward_model's
    ``margin``)."""

    def __init__(self, cfg: PreferenceConfig, reference_free: bool = False):
        super().__init__(cfg)
        self.cfg: PreferenceConfig = cfg
        self.conversational = False
        self.reference_free = reference_free
        """No reference model is loaded and none runs (SimPO, CPO, ORPO)."""
        self._runtime: TaskRuntime | None = None
        """``build_data``'s runtime: ``build_model`` prepares the reference model with it."""
        base = not reference_free and cfg.reference_mode is Reference.base
        self.reference: FrozenCopy | AdaptersDisabled | Precomputed | None = AdaptersDisabled() if base else None
        self._sync_checked = False

    # -- data ----------------------------------------------------------------------------------------------

    def _fields(self, places: Places) -> Any:
        """The columns the task reads and how it fits an item into the block (picklable), for a split's file."""
        raise NotImplementedError

    def _encoder(self, fields: Any) -> Callable[..., dict[str, list]]:
        """``datasets.map``'s function (batched, with indices): records -> items (``<side>_ids``,
        ``<side>_labels``...), with the fitting counts (``pairs.COUNTS``), ``error``, ``place`` and ``raw``."""
        raise NotImplementedError

    def _features(self) -> datasets.Features:
        """The columns :meth:`_encoder` makes."""
        raise NotImplementedError

    def _bad_streamed(self, fields: Any) -> Callable[[list[str], list[int]], list[Skipped]]:
        """A read-ahead's records (texts, byte offsets) -> its bad rows."""
        raise NotImplementedError

    def _stream(self, path: Path, begin: int, fields: Any) -> PairStream:
        """The training file read as a stream of items from byte ``begin``."""
        raise NotImplementedError

    def _check_columns(self, columns: list[str], origin: str) -> None:
        """Refuse a file without the columns the task reads (one sentence naming them)."""
        raise NotImplementedError

    def _conversational(self, record: dict[str, Any]) -> bool:
        """Whether a record goes through the chat template (its prompt or answer is a list of messages)."""
        raise NotImplementedError

    def _completed(self, items: datasets.Dataset, name: str) -> datasets.Dataset:
        """A final split's items, completed where a task needs the whole split (task=kto's KL rows)."""
        return items

    def _reference_key(self, key: str) -> str:
        """The precomputed reference table's key for data of key ``key`` (what else changes its values)."""
        return key

    def _said_at_start(self) -> None:
        """What the log says of the objective once the data is built."""

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        cfg = self.cfg
        check_data_files(cfg.data_files)
        if not runtime.is_main_process:
            import datasets

            datasets.disable_progress_bars()
        self._runtime = runtime  # build_model prepares the reference model with it
        train, evaluation, key = run_main_first(runtime, self._streamed_items if cfg.streaming else self._items_read)
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pad = pad if pad is not None else 0
        self._explicit_mask = runtime.static_shapes
        collate = PairCollator(pad, cfg.block_size if runtime.static_shapes else None, self.sides, self.per_item)
        stream = train if isinstance(train, PairStream) else None
        if stream is not None:
            self._check_stream(runtime, stream, self._bad_streamed(self._fields(Places(str(stream.path), "byte"))))
        if not self.reference_free and cfg.reference_mode is Reference.precomputed:  # item by item, packed or not
            self.reference = Precomputed(self._reference_key(key), (evaluation,) if stream else (train, evaluation),
                                         collate, cfg.reference_batch_size, runtime, stream)
            runtime.register_for_checkpointing(self.reference)
        self._said_at_start()
        if cfg.packing:  # map-style only (the schema refuses packing with streaming)
            packed_train, packed_eval = PackedPairs(train, cfg.block_size), PackedPairs(evaluation, cfg.block_size)
            self._splits_read.append(f"packed: {len(train):,} training {self.unit} into {len(packed_train):,} rows of "
                                     f"{packed_train.capacity} tokens (2 × task.block_size), {len(evaluation):,} "
                                     f"evaluation ones into {len(packed_eval):,}")
            fixed = packed_train.capacity if runtime.static_shapes else None
            return TaskData(train=packed_train, eval=packed_eval,
                            collate_fn=PackedPairCollator(pad, fixed, self.per_item))
        first, second = (f"{side}_ids" for side in self.sides)
        lengths = None if stream else [max(len(a), len(b)) for a, b in zip(train[first], train[second], strict=True)]
        return TaskData(train=train, eval=evaluation, collate_fn=collate, train_lengths=lengths)

    def _streamed_items(self) -> tuple[PairStream, datasets.Dataset, str]:
        """The training file as a stream of items (``stream.PairStream``, each named by its line's byte
        offset); evaluation: the validation file, else the file's first ``task.eval_documents`` records
        (held out of the stream), named -1, -2… Also returns a key of the items."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        assert cfg.data_files.train is not None  # the schema's check for streaming
        path = Path(cfg.data_files.train).expanduser()
        (evaluation, places), begin, sample = self._stream_start(path, root)
        self._check_columns(list(dict.fromkeys(key for record in sample for key in record)), str(path))
        if self._conversational(sample[0]):
            self.conversational = True
            self._check_template()
        data, fitted = self._tokenize(evaluation, places, "validation", root)
        data = self._completed(data, "validation")
        size = path.stat().st_size
        after = " after the evaluation records" if begin else ""
        self._splits_read = [
            (f"train: streamed from {path} ({size - begin:,} bytes{after}, "
             f"{'conversations' if self.conversational else 'text'}), read while training"),
            f"validation: {len(data):,} {self.unit} of {evaluation.origin}{fitted}"]
        return (self._stream(path, begin, self._fields(Places(str(path), "byte"))),
                data.add_column("pair", [-(k + 1) for k in range(len(data))]),
                digest(path.name, str(size), str(begin), evaluation.fingerprint))

    def _items_read(self) -> tuple[datasets.Dataset, datasets.Dataset, str]:
        """Both splits read, checked, tokenized (cached), held out, completed; each item numbered (training
        items first) for the precomputed reference table. Also returns a key of the items."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = self._read(root / "raw")
        train, _ = splits["train"]
        sample = sample_records(train.data)
        self._check_columns(list(dict.fromkeys(key for record in sample for key in record)), train.origin)
        if sample and self._conversational(sample[0]):
            self.conversational = True
            self._check_template()
        rows, read = {}, []
        for name, (split, places) in splits.items():
            data, fitted = self._tokenize(split, places, name, root)
            rows[name] = Split(data, digest(split.fingerprint, f"{cfg.name}-rows"), split.origin)
            read.append(f"{name}: {len(data):,} {self.unit} of {split.origin}"
                        f" ({'conversations' if self.conversational else 'text'})" + fitted)
        if "validation" not in rows:
            rows["train"], rows["validation"] = hold_out(rows["train"], cfg.eval_fraction, cfg.split_seed)
            read.append(f"evaluation: {len(rows['validation'].data):,} of them held out (task.eval_fraction="
                        f"{cfg.eval_fraction}, task.split_seed={cfg.split_seed})")
        self._splits_read = read
        train_rows = self._completed(rows["train"].data, "train")
        eval_rows = self._completed(rows["validation"].data, "validation")
        train_rows = train_rows.add_column("pair", list(range(len(train_rows))))
        eval_rows = eval_rows.add_column("pair", list(range(len(train_rows), len(train_rows) + len(eval_rows))))
        return train_rows, eval_rows, digest(rows["train"].fingerprint, rows["validation"].fingerprint)

    def _tokenize(self, split: Split, places: Places, name: str, root: Path) -> tuple[datasets.Dataset, str]:
        """The split's items (cached), its bad rows judged (``task.bad_rows``) and the dropped ones left out,
        and what was skipped, cut and dropped, for the log."""
        cfg = self.cfg
        fields = self._fields(places)
        payload = {"version": CACHE_VERSION, "task": cfg.name, "tokenizer": tokenizer_fingerprint(self.tokenizer),
                   "template": self.tokenizer.chat_template, "data": split.fingerprint,
                   "fields": {k: v for k, v in dataclasses.asdict(fields).items() if k != "places"}}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
        root.mkdir(parents=True, exist_ok=True)
        data = split.data.map(self._encoder(fields), batched=True, with_indices=True,
                              remove_columns=split.data.column_names, new_fingerprint=key,
                              num_proc=cfg.num_proc if len(split.data) >= 2 * cfg.num_proc > 2 else None,
                              desc=f"Tokenizing {cfg.name} {name}", features=self._features(),
                              cache_file_name=str(root / f"{cfg.name}-{name}-{key}.arrow"), load_from_cache_file=True)
        # Read as lists once: a Dataset's column is read row by row where it is iterated.
        columns = data.select_columns([*COUNTS, "error", "place", "raw"]).to_dict()
        bad = skipped_of(columns, places)
        self._judge(bad, len(data), places.origin)
        counts = {count: sum(columns[count]) for count in COUNTS}
        if counts["dropped"] or bad:
            data = data.select([i for i, (dropped, error) in enumerate(zip(columns["dropped"], columns["error"],
                                                                           strict=True)) if not dropped and not error])
        skipped = f", {len(bad):,} bad row(s) skipped (skipped_rows.jsonl)" if bad else ""
        return data.remove_columns([*COUNTS, "error", "place", "raw"]), skipped + self._fitted(counts)

    def _fitted(self, counts: dict[str, int]) -> str:
        """``, 3 with their prompt cut (task.max_prompt_length=64, keep_end), 1 with an answer cut at
        task.block_size=128, 2 dropped as longer than task.block_size=128``: each item counted once in each."""
        cfg = self.cfg
        to = f"task.max_prompt_length={cfg.max_prompt_length}" if cfg.max_prompt_length is not None \
            else f"to half of task.block_size={cfg.block_size}"
        said = [f"{counts['prompt_cut']:,} with their prompt cut ({to}, {cfg.truncation_mode.value})"
                if counts["prompt_cut"] else "",
                f"{counts['answer_cut']:,} with an answer cut at task.block_size={cfg.block_size}"
                if counts["answer_cut"] else "",
                f"{counts['dropped']:,} dropped as longer than task.block_size={cfg.block_size} (task.overlong=drop)"
                if counts["dropped"] else ""]
        return "".join(f", {part}" for part in said if part)

    # -- model ---------------------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        cfg = self.cfg
        model = load_model(cfg, self.tokenizer, grow_vocabulary=True)
        self._flops_per_token = flops_per_token(model, cfg.block_size)
        if self._explicit_mask:
            use_eager_attention(model)  # before the copy: the reference runs the same attention
        if cfg.packing:
            check_isolation(model, self._explicit_mask)
        mode = cfg.reference_mode
        if self.reference_free:
            log.info("no reference model: the objective reads the policy's log-probabilities alone (one model in "
                     "memory, no reference pass)")
        elif mode in (Reference.copy, Reference.folder) and self.reference is None:
            # Before any adapter: the starting weights. Once: an adapter's export rebuilds the model on
            # the main process alone, and preparing a copy under FSDP2 takes every process.
            if self._runtime is None:
                raise RuntimeError("build_data() keeps the runtime that prepares the reference model; call it first.")
            own = mode is Reference.folder
            self.reference = FrozenCopy(self._reference_model(model) if own else model, self._runtime, copied=not own)
            if cfg.sync_ref_every is not None:  # it moves: every checkpoint holds it
                self._runtime.register_for_checkpointing(self.reference.model)
        return model

    def _reference_model(self, policy: nn.Module) -> nn.Module:
        """``task.reference=<folder>``'s model, loaded as the policy is (the tokenizer's tokens added to its
        vocabulary alike); refused unless its weights have the policy's shapes."""
        cfg = self.cfg
        model = load_model(dataclasses.replace(cfg, model=cfg.reference, config=None), self.tokenizer,
                           grow_vocabulary=True)
        shapes = [tuple(p.shape) for p in model.parameters()]
        if shapes != [tuple(p.shape) for p in policy.parameters()]:
            raise ConfigError(f"task.reference={cfg.reference} is not the policy's architecture ({len(shapes)} weights "
                              f"of other shapes than {model_source(cfg)}'s); give a model of the same architecture and "
                              "vocabulary.")
        if self._explicit_mask:
            use_eager_attention(model)
        log.info("reference model: %s (task.reference), frozen", cfg.reference)
        return model

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        """TR-DPO: every ``task.sync_ref_every`` steps, ``ref ← α·policy + (1-α)·ref``."""
        if not isinstance(self.reference, FrozenCopy):  # nothing to move (none, or no model of its own)
            return
        every = self.cfg.sync_ref_every
        if every is not None and step % every == 0:
            self.reference.move_towards(model, self.cfg.sync_ref_alpha)

    def _check_sync(self, model: nn.Module) -> None:
        """At the first training step: TR-DPO mixes the policy's weights into the reference's, which the
        trained model must then have (not adapters beside frozen weights)."""
        self._sync_checked = True
        if self.cfg.sync_ref_every is not None and any(type(m).__module__.startswith("peft.") for m in model.modules()):
            raise ConfigError("task.sync_ref_every mixes the policy's weights into the reference's, and with "
                              "adapter=lora the policy's weights do not train; leave task.sync_ref_every null "
                              "(or train the whole model).")

    def _logits(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's logits for a batch (a packed one's positions and, on XLA, its explicit mask)."""
        if model.training and not self._sync_checked:
            self._check_sync(model)
        dtype = model.get_input_embeddings().weight.dtype if self._explicit_mask else torch.float32  # type: ignore[operator]
        return model(**model_inputs(batch, self._explicit_mask, dtype), use_cache=False).logits

    data_kind = "preference pairs"
    """What the model card says the data is."""

    def _trained_on(self) -> str:
        """The model card's ``trained on``, before the reference: the objective and its settings."""
        raise NotImplementedError

    def card_facts(self) -> dict[str, str]:
        facts = self._card_of_prompts(self.data_kind, self.conversational)
        facts["trained on"] = f"{self._trained_on()}, reference: {self._reference_facts()}"
        return facts

    def _reference_facts(self) -> str:
        """What the model card says of the reference."""
        cfg = self.cfg
        if self.reference_free:
            return "none (reference-free)"
        said = cfg.reference if cfg.reference_mode is Reference.folder else cfg.reference_mode.value
        if cfg.sync_ref_every is not None:
            said += f", moved towards the policy every {cfg.sync_ref_every} steps (α = {cfg.sync_ref_alpha})"
        return said
