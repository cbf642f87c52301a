"""Worker processes and what runs them.

    config.py     WorkerConfig: flag > KVBRIDGE_* env > TOML > default, read once
    resources.py  pool specs, buffers, contract and aux schema from a config
    synthetic.py  KV bytes as a pure function of (room, pool, layer, token); verification
    pages.py      PageAllocator: contiguous first, held pages for failed rooms (hard rule 6)
    ops.py        the ops channel (Prefill / Decode / Stats / Shutdown), ZMQ + msgpack
    base.py       the shared loop: ops in, rooms advanced, results out; drain on shutdown
    prefill.py    PrefillWorker: synthetic prefill, chunked sends
    decode.py     DecodeWorker: receive, verify every byte, free or hold pages
    runtime.py    running a worker as a process (signals, ready file, exit 0)
    launch.py     starting and stopping processes (demo, bench, tests)
    cluster.py    bootstrap + prefill instance + decode instance on loopback
    inprocess.py  workers as threads, for the local engine
"""
