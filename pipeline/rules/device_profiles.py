"""Accelerator profiles (peak FLOPs, memory, links) kept as data in data/device_profiles.json."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PROFILES_FILE = Path(__file__).parent.parent / "data" / "device_profiles.json"


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, dict]:
    data = json.loads(PROFILES_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def get_profile(name: str) -> dict:
    profiles = load_profiles()
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    if key not in profiles:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[key]


def _normalise(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


def resolve_profile(name: str) -> tuple[str, dict, str | None]:
    """(key, profile with ``links`` resolved, note) for a device name or an alias family.

    An alias such as ``ascend910b`` (910B1-B4) resolves to one concrete model; ``note`` says which
    and how to choose another. Unknown names raise KeyError listing the known ones.
    """
    data = json.loads(PROFILES_FILE.read_text())
    key, note = _normalise(name), None
    aliases = data.get("_aliases", {})
    if key in aliases:
        alias = aliases[key]
        key = alias["resolves_to"]
        others = ", ".join(f for f in alias["family"] if f != key)
        note = f"{name} means {key} ({alias['why']})" + (f"; pass --device {others} for another bin" if others else "")
    profiles = load_profiles()
    if key not in profiles:
        known = sorted(set(profiles) | set(aliases))
        raise KeyError(f"unknown device {name!r}; known: {', '.join(known)}")
    profile = dict(profiles[key])
    for field in ("links", "host_link"):
        if isinstance(profile.get(field), str):
            profile[field] = data["_links"][profile[field]]
    return key, profile, note


def match_device_name(device_name: str) -> str | None:
    """Map a runtime device name (e.g. 'NVIDIA H100 80GB HBM3', 'Ascend910B3') to a profile key."""
    n = device_name.lower().replace(" ", "").replace("-", "")
    for key in sorted(load_profiles(), key=len, reverse=True):
        if key in n:
            return key
    return None
