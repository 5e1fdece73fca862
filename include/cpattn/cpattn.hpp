// Everything public in cpattn.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/merge.hpp>
#include <cpattn/mesh.hpp>
#include <cpattn/npy.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/reference.hpp>
#include <cpattn/worklist.hpp>
