#pragma once
// Umbrella header: everything a program that uses cohort needs.

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/ps.h"
#include "cohort/store.h"
#include "cohort/types.h"
#include "cohort/version.h"
