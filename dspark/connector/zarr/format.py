"""The on-disk format of a Zarr store of per-sample hidden states, shared by its reader and writer.

Layout (one store = one verifier, one layer set, one prepared data set):

    manifest.json                    StoreManifest, written once, exclusively
    segments/<writer>/               one zarr v3 group per writer session
        hidden     [CAP, L+1, H]     uint16 bits of bf16 (or uint8 fp8), token-major; its attributes
                                     record the writer's verifier weights hash
        scales     [CAP, L+1]        float32, fp8 only
        token_ids  [CAP]             int32
        index.bin                    32-byte records: sample_id, start, length, sample checksum, record crc

Why it is safe without locks:
- Each writer session owns a fresh segment, so no chunk is ever shared or
  rewritten: full chunks are written once, the last partial chunk at close.
  Each chunk is written through a temp file and a rename (fsio), as zarr's local store does.
- Arrays are created with a fixed huge capacity; nothing resizes, so array
  metadata is never rewritten after creation.
- A sample's index record is appended only after every chunk holding its
  tokens is written. Readers ignore a torn trailing record, so a sample is
  visible completely or not at all, whenever the writer dies.

Damage (a flipped byte, a lost or truncated chunk file, a damaged index record):
- Index records are fixed-size and each carries its own CRC: a damaged record is
  skipped and counted (`damaged_records`), and every record after it still reads.
- Every sample carries a checksum of its stored bytes (checksum.py: xxh3, or CRC32 in stores
  from before); `read` checks it by default (a few percent of the decode time, see docs/performance.md),
  hashing each piece right after decoding it. A missing or truncated chunk
  file is caught by its length before it is decoded; a garbled one fails the
  checksum or the decode; either way the reader gets `DamagedSample`, never
  wrong numbers.
- Reads are bounded by what the store says, never by the file: a chunk is read only
  if it is a regular file whose size is the one its Blosc header gives, and the
  header must describe this array's chunk. A chunk that is /dev/zero, a FIFO or
  a file grown sparse to 20 GB is a damaged sample, found without reading it.
  index.bin, manifest.json and zarr.json are read only as regular files of bounded
  size; anything else is a `StoreError`.
- Repair appends a fresh copy of a damaged sample to a new segment and leaves the
  damaged one where it is. An id with several records (a repair, or concurrent
  writers that both wrote it) reads from the first record that reads back valid,
  in segment order, so healthy segments are never rewritten.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numcodecs.blosc

from dspark.core.errors import StoreError
from dspark.core.files import FileRefused, read_bounded

CAPACITY = 1 << 40  # tokens per segment; chunks are sparse, so this costs nothing
INDEX_RECORD = struct.Struct("<qqqII")  # sample_id, start, length, sample crc, record crc
_BODY = struct.Struct("<qqqI")
INDEX_BYTES = 1 << 30  # 32M records: more samples than one writer session ever stores
META_BYTES = 1 << 20  # a zarr.json or a repair note; each is a few KB
BLOSC_MAX_OVERHEAD = 16  # Blosc 1 stores data it cannot compress as is, behind its 16-byte header
SEGMENT_FIX = "move that segment folder out of the store: `dspark store repair` then re-extracts the samples it held"


@dataclass(frozen=True)
class IndexEntry:
    segment: str
    start: int
    length: int
    crc: int


def read_index(path: Path) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """CRC-valid records, and (byte offset, valid records after it) of each damaged one.

    Records are fixed-size, so a damaged record hides nothing: the scan goes on at
    the next record boundary. A partial record at the end (a writer killed
    mid-append) is a crash artefact and ignored silently; so are whole zero
    records at the end (a crash that grew the file before its data reached disk).
    """
    try:
        data = read_bounded(path, INDEX_BYTES)
    except FileNotFoundError:
        data = b""  # a segment whose writer has published nothing yet
    except FileRefused as e:
        raise StoreError(f"{path} {e}", SEGMENT_FIX) from None
    end = len(data) - len(data) % INDEX_RECORD.size
    out, bad = [], []
    for off in range(0, end, INDEX_RECORD.size):
        sid, start, length, crc, rcrc = INDEX_RECORD.unpack_from(data, off)
        if zlib.crc32(data[off : off + _BODY.size]) != rcrc:
            bad.append(off)
            continue
        out.append((sid, start, length, crc))
    while bad and bad[-1] == end - INDEX_RECORD.size and not any(data[bad[-1] : end]):
        end = bad.pop()  # a zeroed tail
    # every record before `end` is either valid or damaged: count the valid ones after each damaged one
    return out, [(off, (end - off) // INDEX_RECORD.size - 1 - (len(bad) - k - 1)) for k, off in enumerate(bad)]


def segment_indexes(root: Path):
    """(segment, CRC-valid records, damaged records) of each segment of the store at `root`, in segment order:
    `read_index` of each, and nothing else of the store read (not even its manifest)."""
    seg_root = root / "segments"
    for seg in sorted(p.name for p in seg_root.iterdir()) if seg_root.exists() else []:
        yield seg, *read_index(seg_root / seg / "index.bin")


def index_record(sample_id: int, start: int, length: int, crc: int) -> bytes:
    """One index record, its own CRC last (what `read_index` checks)."""
    body = _BODY.pack(sample_id, start, length, crc)
    return body + struct.pack("<I", zlib.crc32(body))


def chunk_path(array_dir: Path, c: int, ndim: int, sep: str) -> Path:
    """The file of chunk `c` under zarr v3's default chunk key encoding with separator `sep`.

    dspark writes "." (c.7.0.0): every chunk of an array in its one folder, where "/" (c/7/0/0,
    stores written before) costs two mkdirs per chunk, ~0.4 ms each on this machine's disk.
    """
    keys = ["c", str(c), *("0",) * (ndim - 1)]
    return array_dir / ".".join(keys) if sep == "." else array_dir.joinpath(*keys)


# Our reader and writer threads are the parallelism; Blosc's global thread pool (used from the main
# thread otherwise) serializes every caller behind one lock.
numcodecs.blosc.use_threads = False
