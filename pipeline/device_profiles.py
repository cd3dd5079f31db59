"""Accelerator profiles (peak FLOPs, memory, links) kept as data in data/device_profiles.json."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PROFILES_FILE = Path(__file__).parent / "data" / "device_profiles.json"


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


def match_device_name(device_name: str) -> str | None:
    """Map a runtime device name (e.g. 'NVIDIA H100 80GB HBM3', 'Ascend910B3') to a profile key."""
    n = device_name.lower().replace(" ", "").replace("-", "")
    for key in sorted(load_profiles(), key=len, reverse=True):
        if key in n:
            return key
    return None
