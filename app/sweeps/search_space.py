"""The search space of an Optuna sweep, from Hydra's own sweep syntax (parsed by Hydra's override parser):

- ``interval(a, b)``: a float in [a, b]; ``tag(log, interval(a, b))`` on a log scale;
- ``range(start, stop[, step])``: the integers (or floats) Hydra's range gives, stop excluded, as an
  ordered parameter; ``tag(log, range(a, b))`` on a log scale (integers, step 1); ``shuffle(range(...))``:
  unordered, as a choice;
- ``choice(a, b, ...)`` or ``a,b,...``: one of the values, unordered;
- anything else (``key=value``, ``+key=value``, ``~key``): the same for every trial.

A parameter's value in the study (what the dashboard shows, what a sampler models) is a number or a
string; each trial's override is written back in Hydra's syntax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.config import ConfigError

if TYPE_CHECKING:
    import optuna
    from hydra.core.config_loader import ConfigLoader
    from hydra.core.override_parser.types import Override
    from optuna.distributions import BaseDistribution


@dataclass
class SearchSpace:
    distributions: dict[str, BaseDistribution] = field(default_factory=dict)
    """Parameter (an override key, ``+`` or ``~`` included) -> its Optuna distribution."""
    choice_texts: dict[str, list[str]] = field(default_factory=dict)
    """For each categorical parameter, its choices as they are written in an override (same order)."""
    fixed: list[str] = field(default_factory=list)
    """The overrides every trial gets, as given."""

    def suggest(self, trial: optuna.Trial) -> None:
        """Ask the trial's sampler for a value of every parameter (Optuna's public suggest API)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        for name, dist in self.distributions.items():
            if isinstance(dist, FloatDistribution):
                trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)
            elif isinstance(dist, IntDistribution):
                trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
            else:
                assert isinstance(dist, CategoricalDistribution)
                trial.suggest_categorical(name, dist.choices)  # type: ignore[arg-type]

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's job overrides: its parameters (those of this space, and any a custom search space
        added), then the fixed ones."""
        swept = []
        ordered = [n for n in self.distributions if n in params] + [n for n in params if n not in self.distributions]
        for name in ordered:
            value = params[name]
            if name in self.choice_texts:
                dist = self.distributions[name]
                text = self.choice_texts[name][int(dist.to_internal_repr(value))]
            else:
                text = _element(value)
            swept.append(f"{name}={text}")
        return swept + self.fixed

    def grid(self) -> dict[str, list[Any]]:
        """Every parameter's values, for the grid sampler; refuses a continuous parameter."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        values: dict[str, list[Any]] = {}
        for name, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                values[name] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                values[name] = list(range(dist.low, dist.high + 1, dist.step))
            elif isinstance(dist, FloatDistribution) and dist.step is not None:
                count = round((dist.high - dist.low) / dist.step) + 1
                values[name] = [round(dist.low + i * dist.step, 12) for i in range(count)]  # 0.3, not 0.30000000000000004
            else:
                raise ConfigError(f"hydra.sweeper.sampler=grid needs a finite set of values for {name}: give it as "
                                  "choice(...) or range(...), not interval(...).")
        return values


def _element(value: Any) -> str:
    """A number, bool or None as Hydra's override grammar writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_search_space(params: dict[str, str], arguments: Sequence[str],
                       config_loader: ConfigLoader | None = None) -> SearchSpace:
    """``hydra.sweeper.params`` (parameter -> sweep syntax) then the command line's overrides; a later
    override of a key replaces an earlier one (the command line wins over the config). ``config_loader``:
    what ``glob()`` over a config group's options needs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    lines = [f"{key}={value}" for key, value in params.items()] + list(arguments)
    try:
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(lines)
    except OverrideParseException as err:
        raise ConfigError(f"cannot parse the sweep override {err.override!r} ({err.message.splitlines()[0]}); see "
                          "hydra.sweeper.params in conf/hydra/sweeper/optuna.yaml for the syntax.") from None
    latest: dict[str, Override] = {}
    for override in parsed:
        latest.pop(override.get_key_element(), None)  # the later one also takes the later place
        latest[override.get_key_element()] = override
    space = SearchSpace()
    for key, override in latest.items():
        if not override.is_sweep_override():
            assert override.input_line is not None
            space.fixed.append(override.input_line)
        elif override.is_interval_sweep():
            space.distributions[key] = _interval(key, override)
        elif override.is_range_sweep():  # shuffle(range(...)) too: the order is the sampler's business
            space.distributions[key] = _range(key, override)
        else:
            _choice(space, key, override)
    return space


def _interval(key: str, override: Override) -> BaseDistribution:
    from hydra.core.override_parser.types import IntervalSweep
    from optuna.distributions import FloatDistribution

    sweep = override.value()
    assert isinstance(sweep, IntervalSweep) and sweep.start is not None and sweep.end is not None
    _check_tags(key, sweep.tags)
    low, high = float(sweep.start), float(sweep.end)
    if not low < high or ("log" in sweep.tags and low <= 0):
        raise ConfigError(f"{key}: interval({sweep.start}, {sweep.end}) is empty" +
                          (" or not positive, as tag(log, ...) needs." if "log" in sweep.tags else "."))
    return FloatDistribution(low, high, log="log" in sweep.tags)


def _range(key: str, override: Override) -> BaseDistribution:
    from optuna.distributions import FloatDistribution, IntDistribution

    sweep = override.value()
    values: list[int | float] = sorted(override.sweep_iterator())  # type: ignore[arg-type]  # a range's are numbers
    if not values:
        raise ConfigError(f"{key}: {override.get_value_string()} is empty.")
    tags = sweep.tags  # type: ignore[union-attr]
    _check_tags(key, tags)
    step = abs(sweep.step)  # type: ignore[union-attr]
    low, high = values[0], values[-1]
    if isinstance(low, int) and isinstance(high, int) and isinstance(step, int):
        if "log" in tags and (step != 1 or low <= 0):
            raise ConfigError(f"{key}: tag(log, range(...)) needs positive integers with step 1.")
        return IntDistribution(low, high, log="log" in tags, step=step)
    if "log" in tags:
        raise ConfigError(f"{key}: tag(log, range(...)) needs integers; use tag(log, interval(a, b)) for floats.")
    # Hydra's float range adds binary fractions (0.30000000000000004): rounded, the bounds are a whole
    # number of steps apart, as Optuna checks.
    low, high = round(float(low), 12), round(float(high), 12)
    if len(values) == 1:
        return FloatDistribution(low, high)
    return FloatDistribution(low, high, step=float(step))


def _choice(space: SearchSpace, key: str, override: Override) -> None:
    from hydra.core.override_parser.types import ChoiceSweep, Transformer
    from optuna.distributions import CategoricalDistribution

    _check_tags(key, getattr(override.value(), "tags", set()))
    sweep = override.value()
    # As written, also under shuffle(): the study's choices must be the same on every run of the command.
    elements = list(sweep.list) if isinstance(sweep, ChoiceSweep) else list(override.sweep_iterator())  # glob()
    values = [Transformer.encode(e) for e in elements]  # numbers, bools and plain strings as they are
    texts = [Transformer.str(e) for e in elements]
    if not values:
        raise ConfigError(f"{key}: {override.get_value_string()} has no values.")
    if len(set(map(str, values))) < len(values):
        raise ConfigError(f"{key}: {override.get_value_string()} lists a value twice.")
    space.distributions[key] = CategoricalDistribution(values)  # type: ignore[arg-type]  # encode gave primitives
    space.choice_texts[key] = texts


def _check_tags(key: str, tags: set[str]) -> None:
    if tags - {"log"}:
        raise ConfigError(f"{key}: the Optuna sweeper knows the tag log only, not {', '.join(sorted(tags - {'log'}))}.")
