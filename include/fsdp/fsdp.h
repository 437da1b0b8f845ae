// libfsdp's public C++ API in one include: everything the target fsdp::fsdp provides.
//
//   #include <fsdp/fsdp.h>       // find_package(fsdp) ... target_link_libraries(app fsdp::fsdp)
//
// Not included here, as each needs a target of its own:
//   fsdp/bench_report.h     the harness reports (JSON lines, CSV, SVG): fsdp::report
//   fsdp/pjrt_backend.h     the PJRT backend's own API: fsdp::pjrt (COMPONENTS pjrt)
//   fsdp/pjrt_client.h      the PJRT plugin and client under it: fsdp::pjrt
//   fsdp/cuda_backend.h     the CUDA backend's own API: fsdp::cuda (COMPONENTS cuda)
//   fsdp/c_api.h            the C API, in C: libfsdp.so, fsdp::c (COMPONENTS c), docs/c_api.md
// A program reaches every backend this package has by name (fsdp/registry.h) once it links
// fsdp::backends; the backends' own headers are needed only to construct one directly.
#pragma once

#include "fsdp/agreement.h"
#include "fsdp/backend.h"
#include "fsdp/bench.h"
#include "fsdp/checkpoint.h"
#include "fsdp/collective_types.h"
#include "fsdp/communicator.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/data_plane.h"
#include "fsdp/data_position.h"
#include "fsdp/dtype.h"
#include "fsdp/files.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/local_world.h"
#include "fsdp/mesh.h"
#include "fsdp/mpi_world.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/nn/llama.h"
#include "fsdp/nn/model.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_gpt.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/ops.h"
#include "fsdp/optim.h"
#include "fsdp/optim_scalars.h"
#include "fsdp/plan.h"
#include "fsdp/project.h"
#include "fsdp/registry.h"
#include "fsdp/sharding.h"
#include "fsdp/sim_backend.h"
#include "fsdp/status.h"
#include "fsdp/trace.h"
#include "fsdp/wire_format.h"
