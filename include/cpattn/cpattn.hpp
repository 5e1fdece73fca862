// Everything public in cpattn (the target cpattn::cpattn): the MPI-free core and the MPI
// layers, communicator and context-parallel attention.
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/core.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/moe_ep.hpp>
#include <cpattn/executor.hpp>
#include <cpattn/version.hpp>
