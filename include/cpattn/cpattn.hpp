// Everything public in cpattn.
#pragma once

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/worklist.hpp>
