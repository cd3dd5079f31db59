"""What one Hugging Face architecture is, as data (the list: titan_pipe.model.families).

A family is its class name and model_type, the features it always has (titan_pipe.model.features),
how its config spells a sliding window, whether it routes through experts, and, for a family whose
config.json says more than the shared keys (Gemma 3), its own keys: ``OwnKeys`` reads and writes
them and says which values only it has and why it cannot hold a model; and how its checkpoints name
tensors where they differ from the list's names (titan_pipe.model.names). A new family of that kind
is one module that defines its ``Family`` and one line in the list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from titan_pipe.model import features
from titan_pipe.model.features import Feature

if TYPE_CHECKING:  # annotations only: args.py imports the family list, not the reverse
    from titan_pipe.model.args import ModelArgs


@dataclass(frozen=True)
class OwnKeys:
    """A family's own config.json keys and the model values only it has."""

    # (cfg, n_layers=, source=) -> every ModelArgs field its config says beyond the shared keys (its
    # switches, RoPE, activation, windows, tie), each key typed strictly; UserError naming the key
    read: Callable[..., dict]
    # (args) -> its keys of a config.json for ``args``: architectures, model_type, RoPE ("rope_scaling"), ...
    write: Callable[["ModelArgs"], dict]
    # (args) -> (field, value) of the first value only this family has; None: the model sets none
    first_set: Callable[["ModelArgs"], tuple[str, object] | None]
    # (args) -> why it cannot hold ``args``; None when it can
    problem: Callable[["ModelArgs"], str | None]


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its class name, model_type and switches it always has."""

    architecture: str
    model_type: str
    features: tuple[Feature, ...] = ()  # what the architecture always has (titan_pipe.model.features)
    window_keys: str = "none"  # none | mistral (sliding_window) | qwen (per-layer types) | own
    moe: bool = False  # a mixture of experts (the keys: families._read_moe)
    own: OwnKeys | None = None  # its own keys and values (Gemma 3's: titan_pipe.model.gemma3)
    # (native layer-relative name, its Hugging Face name) where its checkpoints spell a parameter otherwise
    hf_names: tuple[tuple[str, str], ...] = ()
    # native names of parameters only its checkpoints hold (in the others their Hugging Face name is another's)
    own_params: tuple[str, ...] = ()
    # its released models' ModelArgs values by flavour name (flow.yaml's model.flavour)
    flavours: Mapping[str, Mapping[str, object]] = field(default_factory=dict, hash=False, compare=False)
    # model_types of relatives it does not compute -> what they are and why (the refusal names them)
    relatives: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def holds(self, args: ModelArgs) -> bool:
        """Whether this architecture's config can say ``args``' switches (a family with keys of its
        own: ``own.problem``)."""
        if self.own is not None:
            return self.own.problem(args) is None
        return (
            self.moe == args.moe
            and set(self.features) == {f for f in features.active(args) if f.switch}
            and not (self.window_keys == "none" and args.sliding_window is not None)
        )

    def claims(self, args: ModelArgs) -> bool:
        """Whether ``args`` sets a value only this family has (so no other can be its family)."""
        return self.own is not None and self.own.first_set(args) is not None

    def switches(self) -> dict[str, bool]:
        """Every feature's switch as this architecture sets it."""
        return {f.name: f in self.features for f in features.FEATURES if f.switch}
