"""The GPU side of the runtime: fatbins, compatibility rules, the machine's GPUs, the CUDA driver, kernels.

archs.py      arch names (sm_90, sm_90a, compute_120) and where the installed fatbins live
fatbin.py     the fatbin reader (SASS/PTX images, ISA, kernels) in pure Python
compat.py     will a fatbin run on GPU X with driver Y: the rules, with their sources
probe.py      this machine's driver and GPUs (NVML)
driver.py     the cuda-python driver layer: context, modules, memory, streams, graphs; one error choke point
constants.py  numbers shared with cuda/*.cu (generates cuda/constants.cuh)
kernels.py    launch geometry: grid/block/shared memory and argument order of every kernel
"""
