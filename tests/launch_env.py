"""What a test gives the `jaxrl` processes it starts only to see them run (not to compare their
numbers with a golden or with another run's).

FAST_COMPILE: LLVM's cheap settings. Every such process compiles programs: multi-turn programs
(host callbacks) are never stored in the persistent cache, and on CPU a process other than
process 0 of a multi-process run never hits it (JAX's cache key hashes the CPU topology, whose
fingerprint differs per process, and only process 0 writes); these flags nearly halve that
compile time and leave the step time as it is (gloo-bound).

SMALL: 4 fake devices in all (2 per process of a two-process run): gloo's TCP collectives
(~2 s per quickstart step on 8 devices, ~0.5 s on 4) and the threads of more devices cost this
2-core machine most of a multi-process test's time.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
SMALL = {"JAXRL_CPU_DEVICES": "4"}
