//! A fenced resource: the storage side of fencing tokens. It remembers the highest token it
//! has seen and refuses writes that carry a lower one, so a holder that was paused past its lease
//! (Kleppmann's scenario) cannot overwrite the work of the holder that came after it.

use std::sync::Mutex;

/// A value guarded by fencing tokens.
#[derive(Debug, Default)]
pub struct FencedResource {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    highest: u64,
    value: Option<String>,
    accepted: Vec<(u64, String)>,
    rejected: Vec<(u64, String)>,
}

impl FencedResource {
    /// An empty resource.
    pub fn new() -> Self {
        FencedResource::default()
    }

    /// Writes `value` if `fence` is at least the highest token seen; returns whether it was
    /// accepted.
    pub fn write(&self, fence: u64, value: impl Into<String>) -> bool {
        let mut s = self.state.lock().unwrap();
        let value = value.into();
        if fence < s.highest {
            s.rejected.push((fence, value));
            return false;
        }
        s.highest = fence;
        s.value = Some(value.clone());
        s.accepted.push((fence, value));
        true
    }

    /// The current value.
    pub fn value(&self) -> Option<String> {
        self.state.lock().unwrap().value.clone()
    }

    /// Accepted writes, in order.
    pub fn accepted(&self) -> Vec<(u64, String)> {
        self.state.lock().unwrap().accepted.clone()
    }

    /// Refused (stale) writes, in order.
    pub fn rejected(&self) -> Vec<(u64, String)> {
        self.state.lock().unwrap().rejected.clone()
    }
}

/// The same rule as a Redis script, for a resource shared by processes: `KEYS[1]` is a hash
/// with the highest fence `f` and the value `v`; `ARGV` are the fence and the value. Returns 1
/// if written, 0 if the fence is stale.
pub const FENCED_WRITE_LUA: &str = "\
local seen = tonumber(redis.call('HGET', KEYS[1], 'f')) or 0
if tonumber(ARGV[1]) < seen then
  redis.call('RPUSH', KEYS[1] .. ':rejected', ARGV[1] .. ' ' .. ARGV[2])
  return 0
end
redis.call('HSET', KEYS[1], 'f', ARGV[1], 'v', ARGV[2])
redis.call('RPUSH', KEYS[1] .. ':accepted', ARGV[1] .. ' ' .. ARGV[2])
return 1";
