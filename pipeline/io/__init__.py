"""The core's io: files: atomic publishing, paths read from files, hashing, every safetensors read and write, operating-system faults as one line."""
