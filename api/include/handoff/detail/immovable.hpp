// A base for types that live where they were made (interfaces used by reference, owners of threads
// or handles): deriving from it deletes their copies and moves, in one place.
#pragma once

namespace handoff::detail {

class immovable {
 public:
  immovable(const immovable&) = delete;
  immovable& operator=(const immovable&) = delete;
  immovable(immovable&&) = delete;
  immovable& operator=(immovable&&) = delete;

 protected:
  immovable() = default;
  ~immovable() = default;
};

}  // namespace handoff::detail
