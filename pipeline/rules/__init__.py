"""The core's rules: closed sets and bounds: choices, limits, strict value reading, thresholds, dtypes, mesh arithmetic, devices and their profiles, sizes."""
