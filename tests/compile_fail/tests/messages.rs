//! What the compiler says to a user who got the layer's configuration
//! wrong: each case under `cases/` must fail to compile with the message
//! in its `.stderr` — one that names the fix.

#[test]
fn mistakes_are_told_with_their_fix() {
    trybuild::TestCases::new().compile_fail("tests/cases/*.rs");
}
