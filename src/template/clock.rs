//! `strftime_now(format)`: today's date and time (UTC) in Python's `strftime` format, for
//! templates that write the date into their system header (Llama 3.2, gpt-oss).

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::Error;

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The current time, formatted.
pub fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(strftime(secs as i64, format))
}

/// Civil date of a day count since 1970-01-01 (proleptic Gregorian): (year, month 1-12, day).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `secs` since the epoch (UTC) in Python's `strftime` directives; an unknown one stays as it is.
pub fn strftime(secs: i64, format: &str) -> String {
    let days = secs.div_euclid(86_400);
    let in_day = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (in_day / 3600, in_day / 60 % 60, in_day % 60);
    let day_of_year = days - {
        let mut jan1 = days - i64::from(d) + 1;
        for month in 1..m {
            jan1 -= month_len(y, month);
        }
        jan1
    } + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let month = MONTHS[(m - 1) as usize];
        match directive {
            'd' => out.push_str(&format!("{d:02}")),
            'e' => out.push_str(&format!("{d:>2}")),
            'm' => out.push_str(&format!("{m:02}")),
            'Y' => out.push_str(&y.to_string()),
            'y' => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            'b' | 'h' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'F' => out.push_str(&format!("{y}-{m:02}-{d:02}")),
            'T' => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

fn month_len(year: i64, month: u32) -> i64 {
    match month {
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_python() {
        // 2026-11-27 08:30:05 UTC, a Friday, day 331.
        let t = 1_795_768_205;
        assert_eq!(strftime(t, "%d %b %Y"), "27 Nov 2026");
        assert_eq!(
            strftime(t, "%Y-%m-%d %H:%M:%S %A %j %B %%"),
            "2026-11-27 08:30:05 Friday 331 November %"
        );
        assert_eq!(strftime(0, "%a %d %b %Y"), "Thu 01 Jan 1970");
        assert_eq!(strftime(951_782_400, "%Y-%m-%d %j"), "2000-02-29 060");
    }
}
