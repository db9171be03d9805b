// EXPECT_DEVICE_ERROR: a device call fails as the runtime it stands for would, with that error's name.
#pragma once

#include <handoff/error.hpp>

#include <gtest/gtest.h>

/// Expects `statement` to throw handoff::device_error named `expected_name` ("cudaErrorInvalidValue").
#define EXPECT_DEVICE_ERROR(statement, expected_name)                   \
  do {                                                                  \
    try {                                                               \
      statement;                                                        \
      ADD_FAILURE() << #statement " did not throw " << (expected_name); \
    } catch (const ::handoff::device_error& error_) {                   \
      EXPECT_EQ(error_.error_name(), (expected_name)) << error_.what(); \
    }                                                                   \
  } while (false)
