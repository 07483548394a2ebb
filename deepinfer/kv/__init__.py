"""The tiered prefix KV store (docs/kv-store.md): the prefix cache's pages kept below the cache pool, in
host memory (L2) and in a page store that outlives one replica (L3: a directory, or Mooncake Store).

- page_store.py: the L3 interface (batch exists / get / put of page records by key) and its URLs;
- file_store.py, mooncake_store.py: its two backends;
- page_record.py: a page's record (the model fingerprint, its key, a checksum, the paged pools' rows);
- fingerprint.py: what a key is salted with so that one model's pages are never read by another;
- host_cache.py: L2, host memory within a byte budget;
- tiered.py: the policy (write-back on a writer thread, prefetch on admission, L1 -> L2 -> L3 lookups).
"""
