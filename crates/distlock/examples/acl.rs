//! Prints the least-privilege `ACL SETUSER` line for locks under a prefix:
//!
//! ```sh
//! cargo run -p distlock --example acl -- myapp          # ACL SETUSER locks on >PASSWORD ...
//! cargo run -p distlock --example acl -- myapp --rules  # the rules alone
//! cargo run -p distlock --example acl -- --library      # the function library, for an
//!                                                       # administrator's FUNCTION LOAD
//! ```

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--library") {
        print!("{}", distlock::function_library());
        return;
    }
    let mut args = std::env::args().skip(1);
    let prefix = args
        .next()
        .unwrap_or_else(|| distlock::DEFAULT_PREFIX.to_owned());
    let rules = distlock::acl_rules(&prefix);
    if args.next().as_deref() == Some("--rules") {
        println!("{rules}");
    } else {
        println!("ACL SETUSER locks on >PASSWORD {rules}");
    }
}
