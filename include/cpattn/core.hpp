// Everything public in cpattn that needs no MPI (the target cpattn::core): planning, layout,
// the attention kernels and their reference, merging, .npy files, the device mesh and the
// pipeline schedules. Include <cpattn/cpattn.hpp> for the MPI layers too. Tensor views
// (tensor.hpp) come in through attention.hpp.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/merge.hpp>
#include <cpattn/mesh.hpp>
#include <cpattn/moe.hpp>
#include <cpattn/npy.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/reference.hpp>
#include <cpattn/sim.hpp>
#include <cpattn/tensor.hpp>
#include <cpattn/version.hpp>
#include <cpattn/worklist.hpp>
