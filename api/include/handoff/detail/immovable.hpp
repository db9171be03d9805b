// A base for types that live where they were made (interfaces used by reference, owners of threads
// or handles): deriving from it deletes their copies and moves, in one place. A class with a
// destructor of its own declares all five itself instead (the rule of five, which clang-tidy's
// cppcoreguidelines-special-member-functions checks on the class alone, not its bases).
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
