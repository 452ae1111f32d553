//! Exit codes, from sysexits(3) where one fits.

/// Bad arguments or configuration, Redis refusing what the lock needs (EX_USAGE).
pub(crate) const USAGE: i32 = 64;
/// Redis could not be reached (EX_UNAVAILABLE).
pub(crate) const UNAVAILABLE: i32 = 69;
/// Internal error (EX_SOFTWARE).
pub(crate) const SOFTWARE: i32 = 70;
/// The lock was not acquired before `--wait` ended (EX_TEMPFAIL).
pub(crate) const TEMPFAIL: i32 = 75;
/// The lease was lost while CMD ran; CMD's group was ended (EX_PROTOCOL).
pub(crate) const LEASE_LOST: i32 = 76;
/// CMD exists but could not be executed (as in sh).
pub(crate) const CANNOT_EXECUTE: i32 = 126;
/// CMD was not found (as in sh).
pub(crate) const NOT_FOUND: i32 = 127;

/// The exit code table shown in `--help`.
pub(crate) const TABLE: &str = "\
Exit status:
  CMD's own exit status (128+N if CMD was killed by signal N)
  64   bad arguments or configuration, or Redis refusing what the lock needs (an ACL
       user without its commands): the reason is printed
  69   Redis unreachable (the error is printed)
  70   internal error
  75   the lock was not acquired before --wait ended (held by another owner)
  76   the lease was lost while CMD ran: CMD's process group was sent SIGTERM (SIGKILL
       after --kill-after), and distlock exited once it was gone
  126  CMD could not be executed
  127  CMD was not found";
