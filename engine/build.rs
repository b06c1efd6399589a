//! The migrations are compiled into the engine (`sqlx::migrate!`): a change to one must
//! rebuild it, or a binary built before would apply (or check a database against) the old text.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
