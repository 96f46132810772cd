"""What XLA did during a run, from torch_xla's metrics and counters: graphs compiled (and how long
that took), graphs loaded from the persistent compile cache, executions, host reads and the
operations that fell back to the CPU. The XLA backend takes a snapshot when it is built and logs the
difference when the run ends (:meth:`XlaCounts.sentence`).

A CPU fallback (a counter ``aten::<op>``) is an operation torch_xla has no lowering for: it copies
the operands to the host, runs the op there and copies the result back, cutting the graph. A host
read (``aten::_local_scalar_dense``, an ``.item()``) is counted apart, as torch_xla's own analysis
does: it is the one way to bring a value to Python, not a missing lowering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOST_READ = "aten::_local_scalar_dense"


@dataclass(frozen=True)
class XlaCounts:
    compiles: int = 0
    """Graphs compiled (torch_xla's ``CompileTime`` samples)."""
    compile_s: float = 0.0
    cache_hits: int = 0
    """Graphs loaded from the persistent compile cache instead of compiled."""
    cache_unloadable: int = 0
    """Graphs found in the persistent compile cache that torch_xla could not load (compiled again):
    torch_xla 2.9 cannot deserialize executables on XLA:CPU, nor on TPU (pytorch/xla#9094)."""
    executions: int = 0
    host_reads: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    """CPU fallback ops by name (``aten::nonzero``...), with how often each ran."""

    @classmethod
    def now(cls) -> XlaCounts:
        """The process's totals so far."""
        import torch_xla.debug.metrics as met

        compile_time = met.metric_data("CompileTime")
        counters = {name: int(met.counter_value(name) or 0) for name in met.counter_names()}
        return cls(compiles=int(compile_time[0]) if compile_time else 0,
                   compile_s=float(compile_time[1]) / 1e9 if compile_time else 0.0,
                   cache_hits=counters.get("PersistentCacheHit", 0),
                   cache_unloadable=counters.get("PersistentCacheDeserializeFailure", 0),
                   executions=counters.get("ExecuteReplicated", 0) + counters.get("ExecuteComputation", 0),
                   host_reads=counters.get(HOST_READ, 0),
                   fallbacks={name: n for name, n in counters.items() if name.startswith("aten::") and name != HOST_READ})

    def since(self, start: XlaCounts) -> XlaCounts:
        """What happened between ``start`` and this snapshot."""
        fallbacks = {name: n - start.fallbacks.get(name, 0) for name, n in self.fallbacks.items()}
        return XlaCounts(compiles=self.compiles - start.compiles, compile_s=self.compile_s - start.compile_s,
                         cache_hits=self.cache_hits - start.cache_hits,
                         cache_unloadable=self.cache_unloadable - start.cache_unloadable,
                         executions=self.executions - start.executions,
                         host_reads=self.host_reads - start.host_reads,
                         fallbacks={name: n for name, n in sorted(fallbacks.items()) if n > 0})

    def sentence(self) -> str:
        """e.g. ``XLA: 9 graph(s) compiled in 21.3 s, 2 loaded from the compile cache, 212 executions, 9 host
        reads; CPU fallback ops: none``."""
        fallbacks = ", ".join(f"{name} x{n}" for name, n in self.fallbacks.items()) or "none"
        unloadable = (f" ({self.cache_unloadable} found there could not be loaded by this torch_xla and were "
                      f"compiled again)" if self.cache_unloadable else "")
        return (f"XLA: {self.compiles} graph(s) compiled in {self.compile_s:.1f} s, {self.cache_hits} loaded from "
                f"the compile cache{unloadable}, {self.executions} executions, {self.host_reads} host reads; "
                f"CPU fallback ops: {fallbacks}")
