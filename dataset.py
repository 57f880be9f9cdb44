"""Everything between "text somewhere" and "a batch on the device".

    python dataset.py download --shards 8            # FineWeb-Edu shards from the hub (+ the last one: validation)
    python dataset.py ingest --out DIR FILES...      # your own .txt / .jsonl / .parquet as shards of the same layout
    python dataset.py demo --out DIR                 # the embedded demo world, offline and deterministic

Layout of a text corpus (FineWeb-Edu's on the hub, and everything this file writes): a directory of parquet shards
named shard_00000.parquet, ..., one string column `text`, row groups of 1024 documents, zstd; the last shard is the
validation split, all others are training.
"""
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))
ROW_GROUP_DOCS = 1024


def default_data_dir(dataset):
    """Downloads live under one cache dir ($NANOCHAT_CACHE, default ~/.cache/nanochat): data/<dataset name>."""
    return CACHE_DIR / "data" / dataset.split("/")[-1]


# -----------------------------------------------------------------------------
# Shards on disk

def list_shards(data_dir):
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: run `python dataset.py download --shards N"
                                f" --data-dir {data_dir}` or `python dataset.py demo --out {data_dir}`")
    shards = sorted(data_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"no .parquet shards in {data_dir}: run `python dataset.py download --shards N "
                                f"--data-dir {data_dir}` or `python dataset.py ingest --out {data_dir} FILES...`")
    return shards


def split_shards(data_dir, split):
    """The last shard is the validation split; all the others are training."""
    shards = list_shards(data_dir)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} is not allowed: choose train or val")
    if len(shards) < 2:
        raise ValueError(f"{data_dir} has {len(shards)} shard; a corpus needs at least two (training shards, then the "
                         f"validation shard last)")
    return shards[:-1] if split == "train" else shards[-1:]


def open_parquet(path, column="text"):
    """Open a shard, with an error that names the file and says how to get a good copy."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e}): delete it and fetch it again (`python "
                         f"dataset.py download` verifies every shard) or re-create it with `python dataset.py "
                         f"ingest`") from e
    if column not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no column {column!r} (columns: {', '.join(parquet.schema_arrow.names)})")
    return parquet


def read_row_group(path, index, column="text"):
    try:
        return open_parquet(path, column).read_row_group(index, columns=[column]).column(column).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: row group {index} is unreadable ({e}): delete the file and fetch it again") from e


def iter_texts(data_dir, split, max_chars=None):
    """Documents of a split in order, empty ones skipped; stops once max_chars characters have been yielded."""
    total = 0
    for path in split_shards(data_dir, split):
        for index in range(open_parquet(path).num_row_groups):
            for text in read_row_group(path, index):
                if not text:
                    continue
                yield text
                total += len(text)
                if max_chars is not None and total >= max_chars:
                    return


def write_text_shards(texts, out_dir, seed=0, shard_docs=8 * ROW_GROUP_DOCS, val_fraction=0.05):
    """Shuffle documents with `seed` and write them in the corpus layout: training shards of `shard_docs` documents,
    then one validation shard (the last file) of val_fraction of the documents (at least one). Returns the paths."""
    texts = list(texts)
    if len(texts) < 2:
        raise ValueError(f"need at least 2 documents to make a training and a validation split, got {len(texts)}")
    random.Random(seed).shuffle(texts)
    n_val = max(1, round(len(texts) * val_fraction))
    train, val = texts[:-n_val], texts[-n_val:]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [train[i:i + shard_docs] for i in range(0, len(train), shard_docs)] + [val]
    paths = []
    for i, chunk in enumerate(chunks):
        path = out_dir / f"shard_{i:05d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.table({"text": pa.array(chunk, pa.string())}), tmp, row_group_size=ROW_GROUP_DOCS,
                       compression="zstd")
        os.replace(tmp, path)  # a shard is visible under its name only once it is complete
        paths.append(path)
    return paths
