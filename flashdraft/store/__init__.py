"""The feature store: target hidden states of many sequences in chunked Zarr v3, with a manifest.

`files` alone knows the store's file and folder names (its docstring draws the layout), `format` what the arrays
hold and how features are encoded, `writer` writes shards and keeps the manifest, `reader` reads sequences back,
`verify` checks a store end to end, `repair` drops the entries of listed shards that are gone or damaged.
"""

from flashdraft.store.files import (
    MANIFEST,
    committed_seq_ids,
    dirs_per_shard,
    files_per_shard,
    is_store,
    next_shard_index,
    read_manifest,
    read_rejects,
    shard_exists,
    shard_name,
    shard_rejects,
    shards_bytes,
    write_rejects,
)
from flashdraft.store.format import FORMAT_VERSION, StoreError, StoreLayout, bytes_per_token
from flashdraft.store.reader import StoredSequence, StoreReader
from flashdraft.store.verify import verify_store
from flashdraft.store.writer import ShardWriter, StoreWriter, write_store

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "ShardWriter",
    "StoreError",
    "StoreLayout",
    "StoreReader",
    "StoreWriter",
    "StoredSequence",
    "bytes_per_token",
    "committed_seq_ids",
    "dirs_per_shard",
    "files_per_shard",
    "is_store",
    "next_shard_index",
    "read_manifest",
    "read_rejects",
    "shard_exists",
    "shard_name",
    "shard_rejects",
    "shards_bytes",
    "verify_store",
    "write_rejects",
    "write_store",
]
