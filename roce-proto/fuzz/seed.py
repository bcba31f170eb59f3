#!/usr/bin/env python3
"""Seed the `frame` fuzz corpus with the real frames of the shared captures
(classic pcap files only). Usage: seed.py CAPTURE_DIR CORPUS_DIR"""
import glob
import os
import struct
import sys

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
n = 0
for path in sorted(glob.glob(os.path.join(src, "*.pcap"))):
    b = open(path, "rb").read()
    if b[:4] != b"\xd4\xc3\xb2\xa1":
        continue
    o = 24
    while o + 16 <= len(b):
        incl = struct.unpack("<I", b[o + 8:o + 12])[0]
        with open(os.path.join(out, f"seed{n}"), "wb") as f:
            f.write(b[o + 16:o + 16 + incl])
        o += 16 + incl
        n += 1
print(f"{n} seeds")
