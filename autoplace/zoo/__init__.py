"""The reference workloads of the device-placement papers, as plain torch models.

    wl = autoplace.zoo.build("inception_v3")                 # paper size, real seeded weights
    wl = autoplace.zoo.build("gpt2", size="xl", device="meta")  # 1.5B parameters, nothing allocated
    wl = autoplace.zoo.build("gnmt4-unrolled", small=True)   # tiny, for tests
    loss = wl.loss_fn(wl.model(*wl.example_inputs), wl.target)
    wl = autoplace.zoo.build_spec("gpt2:xl:batch_size=4")     # the same, as the command line names it

No weights, no downloads, no torchvision: every model is written here. Each has a default
config (the paper's or the usual size, and a training batch size) and a ``small`` config that
keeps the structure (same branching, same layer types) at a size whose forward and backward
run on a CPU in well under a second. Every model goes through ``torch.fx.symbolic_trace``
as it is: no Python control flow on tensor values, sizes held as module attributes.

No model has dropout: the workloads are for planning and for checking rewrites exactly
(same outputs and gradients), and dropout is a cheap elementwise op for a placement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import AutoplaceError
from . import alexnet, bert, gnmt, gpt2, inception, llama, nasnet, resnet, transformer_xl, vgg, wavenet
from .tasks import classification_loss, image_batch, token_batch, token_loss

__all__ = ["Workload", "build", "build_spec", "parse_spec", "names", "presets", "ZooError", "ZooConfigError"]

TEST_CONFIG = ("small", "test")
"""Spec words for a workload's small test config (``build(name, small=True)``)."""


class ZooError(AutoplaceError, ValueError):
    """An unknown workload or preset, or a config value that breaks a rule of the model."""


class ZooConfigError(AutoplaceError, TypeError):
    """A config key the workload does not have, or a value of the wrong type."""

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True, eq=False)
class Workload:
    """A model ready to train one step: ``loss_fn(model(*example_inputs), target)``.

    Compared and hashed by identity (it holds a module and tensors)."""

    name: str
    """The zoo name it was built from."""
    model: nn.Module = field(repr=False)
    """The model, in training mode, on the device asked for."""
    example_inputs: tuple[Tensor, ...] = field(repr=False)
    """Positional arguments of ``model.forward`` for one training batch."""
    target: Tensor = field(repr=False)
    """What ``loss_fn`` compares the model's output with."""
    loss_fn: LossFn = field(repr=False)
    """``loss_fn(output, target) -> scalar tensor``."""
    batch_size: int
    """Examples in ``example_inputs``."""
    config: dict[str, Any]
    """The full resolved config: defaults (or small ones), then the caller's overrides."""


@dataclass(frozen=True)
class _Entry:
    """How one zoo name is built."""

    model: Callable[[Mapping[str, Any]], nn.Module]
    data: Callable[[Mapping[str, Any]], tuple[tuple[Tensor, ...], Tensor]]
    loss_fn: Callable[[Mapping[str, Any]], LossFn]
    default: Mapping[str, Any]
    small: Mapping[str, Any]
    resolve: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Fills derived keys (e.g. a GPT-2 ``size`` preset) after overrides are applied."""
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Named configs (config overrides), e.g. GPT-2's sizes: ``"xl"`` is ``{"size": "xl"}``."""


def _images(cfg: Mapping[str, Any]) -> tuple[tuple[Tensor, ...], Tensor]:
    return image_batch(cfg["batch_size"], cfg["image_size"], cfg["num_classes"])


def _tokens(cfg: Mapping[str, Any]) -> tuple[tuple[Tensor, ...], Tensor]:
    return token_batch(cfg["batch_size"], cfg["seq_len"], cfg["vocab_size"])


def _classification(cfg: Mapping[str, Any]) -> LossFn:
    return classification_loss


def _token_prediction(cfg: Mapping[str, Any]) -> LossFn:
    return token_loss


def _inception_loss(cfg: Mapping[str, Any]) -> LossFn:
    return inception.inception_loss if cfg["aux"] else classification_loss


_ENTRIES: dict[str, _Entry] = {
    "alexnet": _Entry(alexnet.build_alexnet, _images, _classification, alexnet.ALEXNET, alexnet.ALEXNET_SMALL),
    "bert-base": _Entry(bert.build_model, _tokens, _token_prediction, bert.BERT_BASE, bert.BERT_SMALL),
    "gnmt4": _Entry(gnmt.build_model, gnmt.gnmt_batch, _token_prediction, gnmt.GNMT4, gnmt.GNMT4_SMALL),
    "gnmt8": _Entry(gnmt.build_model, gnmt.gnmt_batch, _token_prediction, gnmt.GNMT8, gnmt.GNMT8_SMALL),
    "gnmt4-unrolled": _Entry(gnmt.build_unrolled, gnmt.gnmt_batch, _token_prediction, gnmt.GNMT4_UNROLLED,
                             gnmt.GNMT4_SMALL),
    "gnmt8-unrolled": _Entry(gnmt.build_unrolled, gnmt.gnmt_batch, _token_prediction, gnmt.GNMT8_UNROLLED,
                             gnmt.GNMT8_SMALL),
    "gpt2": _Entry(gpt2.build_model, _tokens, _token_prediction, gpt2.GPT2_DEFAULT, gpt2.GPT2_SMALL, gpt2.resolve,
                   {size: {"size": size} for size in gpt2.PRESETS}),
    "llama": _Entry(llama.build_model, _tokens, _token_prediction, llama.LLAMA_DEFAULT, llama.LLAMA_SMALL,
                    llama.resolve, {size: {"size": size} for size in llama.PRESETS}),
    "inception_v3": _Entry(inception.build_model, _images, _inception_loss, inception.INCEPTION_V3,
                           inception.INCEPTION_V3_SMALL),
    "nasnet": _Entry(nasnet.build_model, _images, _classification, nasnet.NASNET_LARGE, nasnet.NASNET_SMALL),
    "resnet18": _Entry(resnet.build_model, _images, _classification, resnet.RESNET18, resnet.RESNET18_SMALL),
    "resnet50": _Entry(resnet.build_model, _images, _classification, resnet.RESNET50, resnet.RESNET50_SMALL),
    "transformer-xl": _Entry(transformer_xl.build_model, transformer_xl.xl_batch, _token_prediction,
                             transformer_xl.TRANSFORMER_XL, transformer_xl.TRANSFORMER_XL_SMALL),
    "vgg16": _Entry(vgg.build_vgg16, _images, _classification, vgg.VGG16, vgg.VGG16_SMALL),
    "wavenet": _Entry(wavenet.build_model, _tokens, _classification, wavenet.WAVENET, wavenet.WAVENET_SMALL),
}


def names() -> list[str]:
    """Every workload name :func:`build` accepts, sorted."""
    return sorted(_ENTRIES)


def presets(name: str) -> dict[str, dict[str, Any]]:
    """The named configs of workload ``name`` (``{"xl": {"size": "xl"}, ...}`` for gpt2; empty for
    most): each is a set of config overrides, the words a spec may name after the workload."""
    return {k: dict(v) for k, v in _entry(name).presets.items()}


def parse_spec(spec: str) -> tuple[str, bool, dict[str, Any]]:
    """``(name, small, config)`` of a workload spec ``NAME[:WORD]...``, each word one of:

    - ``small`` (or ``test``): the workload's small test config (``build(name, small=True)``);
    - a preset of the workload (:func:`presets`): ``gpt2:xl`` is GPT-2 1.5B;
    - ``KEY=VALUE``: a config override (``gpt2:xl:batch_size=4``); VALUE is read as an int, a
      float, ``true``/``false``, ``none``, else a string.

    Every word takes effect or is refused with the valid choices (:class:`ZooError`), and a spec
    that could mean two things is refused: ``gpt2:small`` (GPT-2's 124M size, which ``gpt2``
    builds, or the test config, ``gpt2:test``). :func:`build` checks the keys and values.
    """
    name, *words = spec.split(":")
    entry = _entry(name)
    small = False
    config: dict[str, Any] = {}
    named: dict[str, Any] = {}  # a preset's keys, under the explicit KEY=VALUE ones wherever they stand
    chosen: list[str] = []
    for word in words:
        if "=" in word:
            key, _, text = word.partition("=")
            if not key.strip():
                raise ZooError(f"workload spec {spec!r}: {word!r} has no key; write KEY=VALUE, e.g. batch_size=4")
            config[key.strip()] = _value(text.strip())
        elif word in entry.presets and word in TEST_CONFIG:
            test = next(w for w in TEST_CONFIG if w not in entry.presets)
            preset = entry.presets[word]
            default = all(entry.default.get(k) == v for k, v in preset.items())
            raise ZooError(f"workload spec {spec!r}: {word!r} could be {name}'s preset {word!r} "
                           f"({_show(preset)}{f', what {name!r} builds by default' if default else ''}) or the "
                           f"zoo's small test config; write {f'{name!r} (or ' if default else ''}"
                           f"{name}:{_show(preset, sep=':')}{')' if default else ''} for the preset, "
                           f"{name}:{test} for the test config")
        elif word in TEST_CONFIG:
            small = True
            chosen.append(word)
        elif word in entry.presets:
            named = dict(entry.presets[word])
            chosen.append(word)
        else:
            tests = [w for w in TEST_CONFIG if w not in entry.presets]
            named_ok = [w for w in entry.presets if w not in TEST_CONFIG]
            raise ZooError(f"workload spec {spec!r}: {word!r} is not a config of {name!r}; after the name come "
                           f"{' or '.join(map(repr, tests))} (the small test config)"
                           + (f", a preset ({', '.join(map(repr, named_ok))})" if named_ok else "")
                           + f" and KEY=VALUE overrides (keys: {', '.join(sorted(entry.default))})")
    if len(chosen) > 1:
        raise ZooError(f"workload spec {spec!r} names {len(chosen)} configs ({', '.join(chosen)}); name one, "
                       "then override keys with KEY=VALUE")
    return name, small, {**named, **config}


def build_spec(spec: str, **kw: Any) -> Workload:
    """:func:`build` the workload a spec names (:func:`parse_spec`); ``kw`` go to :func:`build`."""
    name, small, config = parse_spec(spec)
    return build(name, small=small, **kw, **config)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _show(config: Mapping[str, Any], sep: str = ", ") -> str:
    return sep.join(f"{k}={v}" for k, v in config.items())


def _entry(name: str) -> _Entry:
    if name not in _ENTRIES:
        raise ZooError(f"no zoo workload named {name!r}; the zoo has: {', '.join(names())}")
    return _ENTRIES[name]


def build(name: str, *, small: bool = False, device: str | torch.device = "cpu", seed: int = 0,
          **config: Any) -> Workload:
    """Build the workload ``name``.

    ``small=True`` starts from the tiny test config instead of the default one; ``config``
    keys override either (``build("gpt2", size="xl", batch_size=2)``); unknown keys are an
    error that lists the valid ones. ``device="meta"`` creates parameters, inputs and target on
    the meta device, allocating nothing (trace a 1.5B-parameter GPT for free); any other device
    gets real weights, initialised after ``torch.manual_seed(seed)``, and random inputs drawn
    from seed ``seed + 1``. The caller's global random state is left as it was.

    Raises :class:`ZooError` (a ValueError) for an unknown name or an impossible config (the
    message says which rule), :class:`ZooConfigError` (a TypeError) for an unknown config key or
    a value of the wrong type.
    """
    entry = _entry(name)
    cfg = _resolve(name, entry, small, config)
    dev = torch.device(device)
    with _seeded(seed, dev), dev:
        model = entry.model(cfg)
    with _seeded(seed + 1, dev), dev:
        inputs, target = entry.data(cfg)
    model.train()
    return Workload(name=name, model=model, example_inputs=inputs, target=target,
                    loss_fn=entry.loss_fn(cfg), batch_size=int(cfg["batch_size"]), config=cfg)


def _resolve(name: str, entry: _Entry, small: bool, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Base config, then overrides (checked against the base's keys and value types), then derived keys."""
    base = dict(entry.small if small else entry.default)
    unknown = sorted(set(overrides) - set(base))
    if unknown:
        raise ZooConfigError(f"zoo workload {name!r} has no config key {', '.join(map(repr, unknown))}; "
                        f"valid keys: {', '.join(sorted(base))}")
    reference = entry.resolve(dict(base)) if entry.resolve else base
    for key, value in overrides.items():
        _check_value(name, key, value, reference[key])
    cfg = {**base, **overrides}
    return entry.resolve(cfg) if entry.resolve else cfg


def _check_value(name: str, key: str, value: Any, like: Any) -> None:
    """A config value must have the type of the default it replaces (TypeError); every int knob in
    the zoo is a count or a size, so it must be >= 1 (ValueError)."""
    if isinstance(like, bool):
        ok = isinstance(value, bool)
    elif isinstance(like, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and value < 1:
            raise ZooError(f"zoo workload {name!r}: config {key}={value!r} must be >= 1 (a count or a size)")
    elif isinstance(like, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(like, (tuple, list)):
        ok = isinstance(value, (tuple, list))
    elif isinstance(like, str):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ZooConfigError(f"zoo workload {name!r}: config {key}={value!r} must be {type(like).__name__} "
                        f"like its default {like!r}")


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's generators for the block, restoring the caller's random state after it."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
