#!/usr/bin/env python3
"""Seed the `frame` fuzz corpus with the real frames of the captures (classic
pcap and pcapng, little-endian). From each file, one frame per distinct
(UDP payload opcode byte, frame length), so a capture of thousands of packets
adds its variety, not its bulk. Usage: seed.py CAPTURE_DIR CORPUS_DIR"""
import glob
import os
import struct
import sys


def pcap_frames(b):
    o = 24
    while o + 16 <= len(b):
        incl = struct.unpack("<I", b[o + 8:o + 12])[0]
        yield b[o + 16:o + 16 + incl]
        o += 16 + incl


def pcapng_frames(b):
    o = 0
    while o + 12 <= len(b):
        kind, length = struct.unpack("<II", b[o:o + 8])
        if length < 12:
            return
        if kind == 6:  # Enhanced Packet Block
            cap = struct.unpack("<I", b[o + 20:o + 24])[0]
            yield b[o + 28:o + 28 + cap]
        o += length


src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
n = 0
for path in sorted(glob.glob(os.path.join(src, "*.pcap*"))):
    b = open(path, "rb").read()
    if b[:4] == b"\xd4\xc3\xb2\xa1":
        frames = pcap_frames(b)
    elif b[:4] == b"\x0a\x0d\x0d\x0a" and b[8:12] == b"\x4d\x3c\x2b\x1a":
        frames = pcapng_frames(b)
    else:
        continue
    seen = set()
    for f in frames:
        # Ethernet 14 + IPv4 20 + UDP 8: the BTH opcode (IPv6 frames key on another byte; fine)
        key = (f[42] if len(f) > 42 else None, len(f))
        if key in seen:
            continue
        seen.add(key)
        with open(os.path.join(out, f"seed{n}"), "wb") as w:
            w.write(f)
        n += 1
print(f"{n} seeds")
