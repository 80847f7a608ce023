"""The one place that finds the layers a fastdl conversion replaces, and replaces them.

Matching rule (used by ``fastdl.convert``, ``fastdl.quant.quantize_model`` / ``freeze_model`` and
``fastdl.sparsity.prune`` / ``sparsify``): a module matches when its type is *exactly* one of the requested types
(``nn.Linear`` by default). Subclasses of ``nn.Linear`` are left alone: a subclass may change ``forward``, and some
parents read their child's weight directly instead of calling it (``nn.MultiheadAttention`` passes
``out_proj.weight``, an ``nn.Linear`` subclass, to ``F.multi_head_attention_forward``), so replacing it would
silently change nothing or break the parent. Modules are visited in ``named_modules()`` order, parents before
children, and the children of a matching layer are not searched. The model itself may match (name ``""``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

LINEAR_TYPES: tuple[type, ...] = (nn.Linear,)


@dataclass
class LayerSite:
    """A matching layer: its qualified name, its parent (None for the model itself), its attribute name in the
    parent and its position among the parent's children (to find the module that follows it)."""

    name: str
    module: nn.Module
    parent: nn.Module | None = None
    attr: str = ""
    index: int = 0

    def next_sibling(self) -> tuple[str, nn.Module] | None:
        """(attribute name, module) of the parent's next child, if any."""
        if self.parent is None:
            return None
        children = _children(self.parent)
        return children[self.index + 1] if self.index + 1 < len(children) else None


def _children(parent: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every (attribute, child) registration, also a child registered under several names (``named_children``
    lists it once)."""
    return [(attr, child) for attr, child in parent._modules.items() if child is not None]


def find_layers(
    model: nn.Module,
    types: tuple[type, ...] = LINEAR_TYPES,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    skipped: dict[str, str] | None = None,
    where: str = "fastdl",
) -> list[LayerSite]:
    """The layers of ``model`` whose type is exactly one of ``types`` and that ``filter_fn(name, module)`` accepts
    (default: all). Layers the filter rejects are listed in ``skipped`` (name -> reason) when given."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    sites: list[LayerSite] = []

    def accept(name: str, module: nn.Module) -> bool:
        if type(module) not in types:
            return False
        if filter_fn is not None and not filter_fn(name, module):
            if skipped is not None:
                skipped[name] = "excluded by filter_fn"
            return False
        return True

    if accept("", model):
        return [LayerSite("", model)]

    def walk(parent: nn.Module, prefix: str) -> None:
        for i, (attr, child) in enumerate(_children(parent)):
            name = f"{prefix}.{attr}" if prefix else attr
            if accept(name, child):
                sites.append(LayerSite(name, child, parent, attr, i))
            else:
                walk(child, name)

    walk(model, "")
    return sites


def replace_layer(model: nn.Module, site: LayerSite, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``site`` is; returns the model (``new`` itself when the site is the model)."""
    if site.parent is None:
        return new
    setattr(site.parent, site.attr, new)
    return model


def replace_layers(
    model: nn.Module, sites: list[LayerSite], build: Callable[[LayerSite], nn.Module | None]
) -> nn.Module:
    """Replace each site by ``build(site)`` (None: leave it). A module registered under several names is built
    once and the replacement shared, as the original was. Returns the model (or its replacement)."""
    built: dict[int, nn.Module | None] = {}
    for site in sites:
        key = id(site.module)
        if key not in built:
            built[key] = build(site)
        if built[key] is not None:
            model = replace_layer(model, site, built[key])
    return model
